"""Each real family's chat format, written here from its published chat template: its tokens and a Jinja template
that `apply_chat_template` renders (vLLM and the built-in server render the same one).

What each keeps of its family: the special tokens and their roles, the system prompt the family writes, how tools
are offered, how a call is written in the assistant turn, how a tool's result comes back, and what a reasoning model
drops from past turns. Left out: the images, documents and built-in tools (code interpreter, browser) a template
may also render, which no project check sends.
"""

from __future__ import annotations

from lightning_sdk.models.tiny import CHATML, ChatTokens

QWEN_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>"
)
QWEN_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)

# Qwen2.5-Instruct: ChatML; tools as JSON in <tools> in the system turn (with Qwen's default system prompt when
# there is none); a call is <tool_call>{json}</tool_call>; results are <tool_response> blocks in one user turn.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n""" + QWEN_TOOLS_INTRO + """" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- \"""" + QWEN_TOOLS_OUTRO + """" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
            or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3: Qwen2.5's tools and calls, no default system prompt, and thinking: an assistant turn is
# <think>\n...\n</think>\n\n then the answer. Only the turns after the last user query keep their reasoning (from
# `reasoning_content`, vLLM's `reasoning`, or a <think> block in the content); earlier ones are rebuilt without it.
# enable_thinking=false opens the reply with an empty <think></think>.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- \"""" + QWEN_TOOLS_INTRO + """" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- \"""" + QWEN_TOOLS_OUTRO + """" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
            and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif message.reasoning is string %}
            {%- set reasoning_content = message.reasoning %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                        .split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')
                        + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_TOOLS = (
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\\n\\n' }}\n"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.' }}\n"
    "{{- 'Do not use variables.\\n\\n' }}\n"
    "{%- for t in tools %}\n    {{- t | tojson(indent=4) }}\n    {{- '\\n\\n' }}\n{%- endfor %}\n"
)

# Llama 3.1 / 3.2 / 3.3 Instruct: header tokens around each role, <|eot_id|> after each turn; with tools the
# system turn says "Environment: ipython" and the tools go (as indented JSON) into the first user turn; a call is
# the bare JSON {"name": ..., "parameters": {...}} (one per turn); a result is an `ipython` turn.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
""" + LLAMA3_TOOLS + """{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
""" + LLAMA3_TOOLS + """    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or message.tool_calls) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim
                + '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mistral-7B-Instruct-v0.3 (the v3 control tokens): [INST] turns, the system prompt joined to the last user turn,
# [AVAILABLE_TOOLS] [...] before the last user turn, a call as [TOOL_CALLS] [{"name", "arguments", "id"}]</s>,
# a result as [TOOL_RESULTS] {"content", "call_id"}[/TOOL_RESULTS]; call ids are 9 letters or digits.
MISTRAL_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, "
                ~ "with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# gpt-oss (OpenAI's harmony format): <|start|>ROLE<|message|>...<|end|>; the system turn names the channels, the
# developer turn holds the instructions and the tools as a TypeScript namespace; the assistant thinks on the
# `analysis` channel, answers on `final`, and calls a tool on `commentary` addressed to=functions.NAME with JSON
# arguments, ending <|call|>; a result is a turn from functions.NAME to=assistant. A past turn's analysis is dropped
# once a final answer follows it. A reply ends with <|return|> or <|call|>.
GPT_OSS_TEMPLATE = """{%- macro ts_type(p) -%}
    {%- if p.type == "string" -%}
        {%- if p.enum is defined -%}{{ p.enum | map("tojson") | join(" | ") }}{%- else -%}string{%- endif -%}
    {%- elif p.type == "integer" or p.type == "number" -%}number
    {%- elif p.type == "boolean" -%}boolean
    {%- elif p.type == "array" -%}{{ ts_type(p.items or {}) }}[]
    {%- elif p.type == "object" -%}object
    {%- else -%}any
    {%- endif -%}
{%- endmacro -%}
{%- if not reasoning_effort is defined %}
    {%- set reasoning_effort = "medium" %}
{%- endif %}
{%- if messages and messages[0].role in ("system", "developer") %}
    {%- set instructions = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set instructions = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n" }}
{{- "Knowledge cutoff: 2024-06\\n" }}
{{- "Current date: " + (current_date if current_date is defined else "2025-06-28") + "\\n\\nReasoning: "
        + reasoning_effort + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}
    {{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- "<|end|>" }}
{%- if instructions or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if instructions %}
        {{- "# Instructions\\n\\n" + instructions }}
        {%- if tools %}{{- "\\n\\n" }}{%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- "# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n" }}
        {%- for tool in tools %}
            {%- set f = tool.function if tool.function is defined else tool %}
            {{- "// " + (f.description or "") + "\\ntype " + f.name + " = " }}
            {%- set props = (f.parameters or {}).properties or {} %}
            {%- if props %}
                {{- "(_: {\\n" }}
                {%- for name, p in props.items() %}
                    {%- if p.description %}{{- "// " + p.description + "\\n" }}{%- endif %}
                    {{- name + ("" if name in ((f.parameters or {}).required or []) else "?") + ": " + ts_type(p)
                            + ",\\n" }}
                {%- endfor %}
                {{- "}) => any;\\n\\n" }}
            {%- else %}
                {{- "() => any;\\n\\n" }}
            {%- endif %}
        {%- endfor %}
        {{- "} // namespace functions" }}
    {%- endif %}
    {{- "<|end|>" }}
{%- endif %}
{%- set ns = namespace(last_final=-1, tool_name="") %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and not message.tool_calls %}
        {%- set ns.last_final = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- elif message.role == "assistant" %}
        {%- set thinking = message.reasoning_content if message.reasoning_content is string
                else (message.reasoning if message.reasoning is string
                else (message.thinking if message.thinking is string else "")) %}
        {%- if thinking and loop.index0 > ns.last_final %}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + thinking + "<|end|>" }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- set call = message.tool_calls[0].function if message.tool_calls[0].function is defined
                    else message.tool_calls[0] %}
            {%- set ns.tool_name = call.name %}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- "<|call|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + (message.content or "") + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "tool" %}
        {{- "<|start|>functions." + (message.name or ns.tool_name) + " to=assistant<|channel|>commentary<|message|>" }}
        {{- message.content if message.content is string else message.content | tojson }}
        {{- "<|end|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start|>assistant" }}
{%- endif %}
"""

GEMMA3_TOOLS_INTRO = (
    "Tools (functions) are available. If you decide to invoke one or more of the tools, you must respond with a "
    "python list of the function calls.\\nExample Format: [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)] \\nDo not use variables. DO NOT USE MARKDOWN SYNTAX. You "
    "SHOULD NOT include any other text in the response if you call a function. If none of the function can be used, "
    "point it out. If the given question lacks the parameters required by the function, also point it out.\\nHere "
    "is a list of functions in JSON format that you can invoke.\\n"
)

# Gemma 3 (instruction-tuned): <start_of_turn>user / model, <end_of_turn> after each turn, the system prompt
# joined to the first user turn. Gemma 3 has no tool tokens; Google's function-calling guide and vLLM's
# tool_chat_template_gemma3_pythonic.jinja offer the tools as JSON in the first user turn and have the model answer a
# Python list of calls, [name(arg=value)], which vLLM's `pythonic` parser reads; results come back in a user turn
# as ```tool_output blocks.
GEMMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
    {%- set ns = namespace(tools_text=\"""" + GEMMA3_TOOLS_INTRO + """\") %}
    {%- for tool in tools %}
        {%- set ns.tools_text = ns.tools_text + (tool | tojson(indent=4)) + '\\n\\n' %}
    {%- endfor %}
    {%- set first_user_prefix = first_user_prefix + ns.tools_text %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}
            {{- '<start_of_turn>user\\n' }}
        {%- endif %}
        {{- '```tool_output\\n' + (message.content if message.content is string else message.content | tojson)
                + '\\n```' }}
        {%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}
            {{- '<end_of_turn>\\n' }}
        {%- else %}
            {{- '\\n' }}
        {%- endif %}
    {%- else %}
        {%- set role = "model" if message.role == 'assistant' else message.role %}
        {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
        {%- if message.content is string %}
            {{- message.content | trim }}
        {%- endif %}
        {%- if message.tool_calls %}
            {{- '[' }}
            {%- for tool_call in message.tool_calls %}
                {%- set f = tool_call.function if tool_call.function is defined else tool_call %}
                {{- f.name + '(' }}
                {%- set args = f.arguments if f.arguments is mapping else {} %}
                {%- for name, value in args.items() %}
                    {{- name + '=' + (value | tojson) }}
                    {%- if not loop.last %}{{- ', ' }}{%- endif %}
                {%- endfor %}
                {{- ')' }}
                {%- if not loop.last %}{{- ', ' }}{%- endif %}
            {%- endfor %}
            {{- ']' }}
        {%- endif %}
        {{- '<end_of_turn>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

QWEN25 = ChatTokens(special=CHATML.special, eos="<|im_end|>", pad="<|endoftext|>", template=QWEN25_TEMPLATE,
                    plain=("<tool_call>", "</tool_call>"))
QWEN3 = ChatTokens(special=CHATML.special, eos="<|im_end|>", pad="<|endoftext|>", template=QWEN3_TEMPLATE,
                   plain=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                          "</think>"))
LLAMA3 = ChatTokens(special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
                    eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
                    template=LLAMA3_TEMPLATE)
MISTRAL = ChatTokens(special=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                              "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
                     eos="</s>", pad="<unk>", bos="<s>", template=MISTRAL_TEMPLATE)
GPT_OSS = ChatTokens(special=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                              "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
                     eos="<|return|>", pad="<|endoftext|>", template=GPT_OSS_TEMPLATE)
GEMMA3 = ChatTokens(special=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
                    eos="<eos>", pad="<pad>", bos="<bos>", template=GEMMA3_TEMPLATE)
