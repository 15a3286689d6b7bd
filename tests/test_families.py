"""Each real family's tool-call format on the built-in server: hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.x),
mistral, openai/harmony (gpt-oss) and pythonic (Gemma 3), on the small random-weight model of each family
(models/families.py, with the family's own chat template and special tokens).

First the readers on their own (a reply streamed a character at a time reads as the whole one). Then, per family,
real OpenAI-client calls through the gateway to the built-in server on 127.0.0.1, recorded into SQLite: forced
tool calls (tool_choice "required" and named, streamed and not) come back parsed, the record's ids are what was
sampled, the trainer replays the format's grammar over them (no call left out, log-probs equal to the server's);
response_format json_schema holds; Qwen3's thinking comes back as reasoning_content. Then one `lightning run`
iteration per family of an agent whose only call is a forced tool call, rewarded from its arguments, which trains,
on the built-in server and (the `vllm` lane) on vLLM's CPU build.
The grammars themselves are checked against vLLM's own (the `vllm` lane: vLLM imported, no server).
"""

from __future__ import annotations

import io
import json
import textwrap

import openai
import pytest
import torch
from rich.console import Console

from lightning_sdk import config, models, tracing
from lightning_sdk.config import TrainConfig
from lightning_sdk.constraint import Constraint, format_grammar, from_request
from lightning_sdk.engine import toolcalls
from lightning_sdk.engine.toolcalls import Forced, Reader, Thinking, tool_format
from lightning_sdk.runtime import Runtime
from lightning_sdk.models import tool_parsers
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.train.trainer import GRPOTrainer
from lightning_sdk.transitions import to_transitions

from .conftest import SERVED, gateway_in_front_of, in_rollout

torch.set_num_threads(1)

# family -> (vLLM's tool-call parser, its reasoning parser), as detected from the model
FAMILIES = {"qwen2.5": ("hermes", None), "qwen3": ("hermes", "qwen3"), "llama3": ("llama3_json", None),
            "mistral": ("mistral", None), "gpt-oss": ("openai", "openai_gptoss"), "gemma3": ("pythonic", None)}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "echo", "parameters": {
             "type": "object", "properties": {"word": {"type": "string", "enum": ["yes", "no"]}},
             "required": ["word"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "add"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}


# ---- the readers ----

def read_streamed(reader: Reader, text: str) -> dict:
    """`text` streamed a character at a time through a StreamShaper: the message its deltas add up to."""
    shaper = toolcalls.StreamShaper(1, reader)
    out = {"content": "", "reasoning_content": "", "tool_calls": []}
    for k, ch in enumerate(text):
        delta, _ = shaper.delta(0, ch, "stop" if k == len(text) - 1 else None)
        out["content"] += delta["content"]
        out["reasoning_content"] += delta.get("reasoning_content", "")
        out["tool_calls"] += delta.get("tool_calls", [])
    return out


def functions(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


PROSE = 'Sure, I will call it {"name": "f", "parameters": {"a": 1}} and then explain.'
CALL_THEN_PROSE = '{"name": "f", "parameters": {"a": 1}} and then explain.'
READS = [  # (format, reasoning, forced, text) -> (content, calls, reasoning)
    ("hermes", None, None, 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     ("Sure.", [("add", {"a": 1, "b": 2})], "")),
    ("hermes", "qwen3", None, '<think>\nadd them</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
     '"b": 2}}\n</tool_call>', (None, [("add", {"a": 1, "b": 2})], "\nadd them")),
    ("hermes", "qwen3", None, "still thinking", (None, [], "still thinking")),
    ("llama3_json", None, None, '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}',
     (None, [("add", {"a": 3, "b": 4})], "")),
    ("llama3_json", None, None, 'The answer is 7.', ("The answer is 7.", [], "")),
    ("mistral", None, None, 'Calling. [TOOL_CALLS] [{"name": "echo", "arguments": {"word": "yes"}}, {"name": "add", '
     '"arguments": {"a": 1, "b": 1}}]', ("Calling. ", [("echo", {"word": "yes"}), ("add", {"a": 1, "b": 1})], "")),
    ("mistral", None, Forced("add"), '[{"name":"add","arguments":{"a":5,"b":6}}]', (None, [("add", {"a": 5, "b": 6})],
                                                                                    "")),
    ("openai", "openai_gptoss", None, "<|channel|>analysis<|message|>add 2 and 2<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 2}', (None, [("add", {"a": 2, "b": 2})],
                                                                                   "add 2 and 2")),
    ("openai", "openai_gptoss", None, "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.", ("It is 4.", [], "easy")),
    ("pythonic", None, None, '[add(a=1, b=2), echo(word="no")]', (None, [("add", {"a": 1, "b": 2}),
                                                                         ("echo", {"word": "no"})], "")),
    ("pythonic", None, None, "I do not know [1].", ("I do not know [1].", [], "")),
    ("pythonic", None, Forced("add"), '{"a":1,"b":9}', (None, [("add", {"a": 1, "b": 9})], "")),
    ("pythonic", None, Forced(), '[{"name":"echo","parameters":{"word":"no"}}]', (None, [("echo", {"word": "no"})],
                                                                                   "")),
    # Not all calls: the whole reply is content, nothing of it lost, no call invented
    ("llama3_json", None, None, PROSE, (PROSE, [], "")),
    ("llama3_json", None, None, CALL_THEN_PROSE, (CALL_THEN_PROSE, [], "")),
    ("llama3_json", None, None, '{"name": "f", "parameters": {"a": NaN}}', ('{"name": "f", "parameters": {"a": NaN}}',
                                                                            [], "")),
    ("llama3_json", None, None, '{"name": 5, "parameters": {}}', ('{"name": 5, "parameters": {}}', [], "")),
    ("llama3_json", None, None, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "echo", "arguments": '
     '{"word": "no"}}', (None, [("add", {"a": 1}), ("echo", {"word": "no"})], "")),
    ("mistral", None, None, "Hello there [TOOL_CALLS]not json", ("Hello there [TOOL_CALLS]not json", [], "")),
    ("mistral", None, None, '[TOOL_CALLS][{"arguments": {"a": 1}}]', ('[TOOL_CALLS][{"arguments": {"a": 1}}]', [], "")),
    ("mistral", None, None, '[TOOL_CALLS][{"name": "f", "arguments": {"a": NaN}}]',
     ('[TOOL_CALLS][{"name": "f", "arguments": {"a": NaN}}]', [], "")),
    ("mistral", None, None, ' [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', (None, [("add", {"a": 1})], "")),
    # text after the array is content, as vLLM streams it (a later marker dropped, as vLLM drops it)
    ("mistral", None, None, 'Hi [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}] after',
     ("Hi  after", [("add", {"a": 1})], "")),
    ("mistral", None, None, 'Hi [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}][TOOL_CALLS][{"name": "echo"}]',
     ('Hi [{"name": "echo"}]', [("add", {"a": 1})], "")),
    ("pythonic", None, None, "[f(a=1e999)]", ("[f(a=1e999)]", [], "")),
    ("hermes", None, None, '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>',
     ('<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>', [], "")),
    ("openai", "openai_gptoss", None, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": NaN}'
     '<|call|>', ('{"a": NaN}', [], "")),
]


@pytest.mark.parametrize("fmt,reasoning,forced,text,expected", READS)
def test_each_format_reads_a_reply_and_its_stream_alike(fmt, reasoning, forced, text, expected):
    reader = Reader(tool_format(fmt), Thinking(closed=False) if reasoning == "qwen3" else None, forced)
    message, finish = toolcalls.message(text, "stop", reader)
    content, calls, thought = expected
    assert (message["content"], functions(message["tool_calls"]), message.get("reasoning_content", "")) == \
        (content, calls, thought)
    assert finish == ("tool_calls" if calls else "stop")
    streamed = read_streamed(reader, text)
    assert streamed["content"] == (message["content"] or "")
    assert streamed["reasoning_content"] == message.get("reasoning_content", "")
    assert functions(streamed["tool_calls"]) == calls
    if fmt == "mistral":  # the ids mistral's template takes back: 9 letters and digits
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message["tool_calls"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_format_is_detected_from_each_family_s_model(family):
    template, model_type = tool_parsers.model_files(models.resolve(f"family:{family}"))
    assert (tool_parsers.tool_call_parser_for(template, model_type),
            tool_parsers.reasoning_parser_for(template, model_type)) == FAMILIES[family]


# ---- the forced-call grammars are vLLM's own ----

@pytest.mark.vllm
@pytest.mark.parametrize("fmt", ["llama3_json", "openai", "mistral", "pythonic"])
def test_each_format_s_forced_call_grammar_is_the_one_vllm_applies(fmt):
    """vLLM 0.32's own builders for the same request (with --tool-strict-level parameter): the structural tags
    compile to the same grammar, the bare-JSON schemas are equal."""
    xgr = pytest.importorskip("xgrammar")
    pytest.importorskip("vllm")
    import vllm.parser.harmony as harmony  # registers the "harmony" structural tag
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.mistral import MistralParser
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    def grammar(tag: dict) -> str:
        return str(xgr.Grammar.from_structural_tag(json.dumps(tag)))

    for extra in ({"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False},
                  {"tool_choice": NAMED}, {"response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "a", "schema": SCHEMA}}}):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra,
                **({} if "response_format" in extra else {"tools": TOOLS})}
        req = ChatCompletionRequest(**body)
        ours = format_grammar(from_request(body), fmt)
        if "response_format" in extra:
            if fmt == "openai":  # gpt-oss's JSON goes in its final channel
                theirs = harmony._adjust_output_format(req).structured_outputs.structural_tag
                assert grammar(json.loads(theirs)) == grammar(ours.spec)
            else:
                assert ours.kind == "json_schema" and ours.spec == SCHEMA
            continue
        if fmt in ("llama3_json", "openai"):
            tag = get_model_structural_tag("llama" if fmt == "llama3_json" else "harmony", req.tools, req.tool_choice,
                                           False, strict_level=ToolStrictLevel.PARAMETER)
            if req.parallel_tool_calls is False:
                limit_to_single_tool_call(tag)
            assert ours.kind == "structural_tag" and grammar(tag.model_dump()) == grammar(ours.spec)
        elif fmt == "mistral":  # a Hugging Face tokenizer: vLLM's pre-v11 guided array
            assert ours.kind == "json_schema" and ours.spec == MistralParser._build_guided_schema_pre_v11(None, req)
        else:
            theirs = get_json_schema_from_tools(req.tool_choice, req.tools, req.parallel_tool_calls)
            assert ours.kind == "json_schema" and ours.spec == theirs
    # tool_choice "auto" (recorded as i51-tools' constraint.py records it, "choice": "auto"): vLLM's tag for the
    # formats that have one, no grammar for the others; with a response format (llama3_json), calls or the format
    auto = Constraint("tool_calls", {"tools": [{"name": t["function"]["name"], "parameters": t["function"][
        "parameters"]} for t in TOOLS], "choice": "auto", "one": False}, "tool_choice")
    ours = format_grammar(auto, fmt)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    if fmt in ("mistral", "pythonic"):
        assert ours is None
        return
    tag = get_model_structural_tag("llama" if fmt == "llama3_json" else "harmony", req.tools, "auto", False,
                                   strict_level=ToolStrictLevel.PARAMETER)
    assert grammar(tag.model_dump()) == grammar(ours.spec)
    if fmt == "llama3_json":
        from vllm.parser.abstract_parser import structured_outputs_to_format
        from vllm.sampling_params import StructuredOutputsParams
        with_text = Constraint("tool_calls", {**auto.spec, "text": {"kind": "json_schema", "spec": SCHEMA}}, "x")
        tools_tag = get_model_structural_tag("llama", req.tools, "required", False,
                                             strict_level=ToolStrictLevel.PARAMETER)
        theirs = {"type": "structural_tag", "format": {"type": "or", "elements": [
            tools_tag.format.model_dump(), structured_outputs_to_format(StructuredOutputsParams(
                json=SCHEMA)).model_dump()]}}
        assert grammar(theirs) == grammar(format_grammar(with_text, fmt).spec)


VLLM_READS = [  # (family, parser, tool_choice, text)
    ("qwen2.5", "hermes", "auto", 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    ("llama3", "llama3_json", "auto", '{"name": "add", "parameters": {"a": 3, "b": 4}}'),
    ("llama3", "llama3_json", "auto", "The answer is 7."),
    ("mistral", "mistral", "auto", 'Calling. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 1}}]'),
    ("mistral", "mistral", "required", '[{"name":"add","arguments":{"a":5,"b":6}}]'),
    ("gemma3", "pythonic", "auto", "[add(a=1, b=2), echo(word='no')]"),
    ("gemma3", "pythonic", "auto", "I do not know."),
]


@pytest.mark.vllm
def test_each_format_reads_a_reply_as_vllm_s_parser_does():
    """vLLM's own tool parsers (and its qwen3 reasoning parser) on the family's tokenizer, no server: the same
    calls and content (hermes' content without its trailing space: the built-in server trims it)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    for family, parser, choice, text in VLLM_READS:
        tok = get_tokenizer(models.resolve(f"family:{family}"))
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                    tool_choice=choice)
        info = ToolParserManager.get_tool_parser(parser)(tok, req.tools).extract_tool_calls(text, req)
        theirs = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
        ours, _ = toolcalls.message(text, "stop", Reader(tool_format(parser), None,
                                                         Forced() if choice == "required" else None))
        assert functions(ours["tool_calls"]) == theirs, (parser, text)
        content = info.content.strip() if parser == "hermes" and info.content else info.content
        assert ours["content"] == content, (parser, text)
    tok = get_tokenizer(models.resolve("family:qwen3"))
    thinker = ReasoningParserManager.get_reasoning_parser("qwen3")
    for text in ["<think>\nadd them</think>\n\nIt is 7.", "still thinking", "add them</think>It is 7."]:
        reasoning, rest = Thinking(closed=False).split(text, final=True)
        assert (reasoning or None, rest) == thinker(tok).extract_reasoning(text, ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "x"}]))


# ---- each family on the built-in server, through the gateway ----

def _ask(client, family: str, *, seed: int, stream: bool = False, **kw):
    """One chat call; Qwen3 without thinking where a grammar applies from the first token."""
    extra = {"return_token_ids": True}  # the gateway hands the ids back only when asked, as vLLM does
    if family == "qwen3" and not kw.pop("thinking", False):
        extra["chat_template_kwargs"] = {"enable_thinking": False}
    r = client.chat.completions.create(model=SERVED, seed=seed, stream=stream, temperature=1.0,
                                       messages=[{"role": "user", "content": f"What is {seed} + 4?"}],
                                       extra_body=extra, **kw)
    if not stream:
        c = r.choices[0]
        return c.message.content, functions([t.model_dump() for t in c.message.tool_calls or []]), \
            c.model_extra["token_ids"], c.finish_reason, getattr(c.message, "reasoning_content", None)
    content, calls, ids, finish, reasoning = "", {}, [], None, ""
    for chunk in r:
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for t in c.delta.tool_calls or []:
                calls[t.index] = (t.function.name, json.loads(t.function.arguments))
            ids += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], ids, finish, reasoning or None


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, tmp_path_factory):
    family = request.param
    path = models.resolve(f"family:{family}")
    with CPUServer(path, served_model_name=SERVED, threads=1, max_model_len=2048,
                   log_path=tmp_path_factory.mktemp("srv") / "server.log") as server:
        with gateway_in_front_of(server) as gw:
            yield family, path, gw


def test_forced_calls_structured_output_and_reasoning_on_the_built_in_server(family_server, store):
    family, path, gw = family_server
    tracing.install(store, gateway_url=gw.base_url)
    gw.capture.record_to(store)
    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    replies = {}
    try:
        for i, choice in enumerate(["required", NAMED] * 2):
            rid = f"r{i}"
            store.start_rollout(rid, task_id="t", group_id="g", iteration=0, phase="train")
            with in_rollout(gw, rid):
                replies[rid] = _ask(client, family, seed=i, tools=TOOLS, tool_choice=choice, max_tokens=160)
                # the same call streamed: the same tokens, read the same way
                assert _ask(client, family, seed=i, stream=True, tools=TOOLS, tool_choice=choice,
                            max_tokens=160) == replies[rid]
            store.finish_rollout(rid, status="succeeded", output="", reward=float(i % 2))
        assert gw.capture.flush()
        tracing.flush()
    finally:
        gw.capture.record_to(None)
    done = 0
    for i, (content, calls, ids, finish, _) in enumerate(replies.values()):
        # A call cut by max_tokens (gpt-oss's random weights fill the free whitespace its tag allows), or followed
        # by text that is not a call (llama3_json's "required" lets text follow a call), reads as no call: as vLLM's
        # parsers read it
        if not calls:
            continue
        done += 1
        assert finish in ("tool_calls", "length"), (family, finish)  # "required": text may follow the call
        # gpt-oss may write a commentary first; a second call cut by max_tokens stays text
        assert content is None or family == "gpt-oss" or finish == "length", (family, content)
        assert calls[0][0] == "add" if i % 2 else calls[0][0] in ("add", "echo")
        assert all(set(args) == ({"a", "b"} if name == "add" else {"word"}) for name, args in calls)
    # the gateway varies a training call's seed per rollout (a random trace id): how many run to max_tokens varies
    assert done >= 1, f"{family}: none of 4 forced calls read"
    # the records hold exactly the sampled ids, and the trainer replays the format's grammar over them
    ts = [t for rid in replies for t in to_transitions(store.rollout(rid), store.spans(rid))
          if t.constraint is not None]
    assert [list(t.completion_ids) for t in ts] == [r[2] for r in replies.values() for _ in range(2)]  # plain, streamed
    m = GRPOTrainer(path, TrainConfig(device="cpu", lora_r=4)).step(ts)
    assert m["num_constrained"] == 8 and m["constraint_mismatch"] == 0, (family, m)
    print(f"{family}: {done} of 4 forced calls read, logprob_gap {m['logprob_gap']:.2e} over 8 constrained calls")
    assert m["logprob_gap"] <= 1e-5, (family, m["logprob_gap"])
    # structured output: the reply is the schema's JSON
    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    content, calls, _, finish, _ = _ask(client, family, seed=7, max_tokens=96, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    if finish != "length":
        assert set(json.loads(content)) == {"answer"} and not calls, (family, content)
    # a call comes back in the next prompt with its result, as the family's template renders them
    off = {"chat_template_kwargs": {"enable_thinking": False}} if family == "qwen3" else {}
    for seed in range(4):  # the first call that finishes within max_tokens
        r = client.chat.completions.create(model=SERVED, seed=seed, max_tokens=96, tools=TOOLS, tool_choice=NAMED,
                                           messages=[{"role": "user", "content": "What is 0 + 4?"}], extra_body=off)
        if r.choices[0].message.tool_calls:
            break
    call = r.choices[0].message.tool_calls[0]
    again = client.chat.completions.create(model=SERVED, seed=0, max_tokens=4, tools=TOOLS, extra_body={
        "return_token_ids": True, **off}, messages=[{"role": "user", "content": "What is 0 + 4?"},
                                             r.choices[0].message.model_dump(exclude_none=True),
                                             {"role": "tool", "tool_call_id": call.id, "content": "4"}])
    prompt = models.load_tokenizer(path).decode(again.model_extra["prompt_token_ids"])
    assert all(f'{json.dumps(k)}' in prompt for k in json.loads(call.function.arguments)), prompt
    if family == "qwen3":
        qwen3_s_thinking_is_reasoning_content(client)


def qwen3_s_thinking_is_reasoning_content(client):
    """Qwen3 thinks by default: its reply reads as vLLM's qwen3 reasoning parser reads it."""
    family = "qwen3"
    content, _, ids, finish, reasoning = _ask(client, family, seed=3, thinking=True, max_tokens=24)
    streamed = _ask(client, family, seed=3, thinking=True, max_tokens=24, stream=True)
    assert (content, ids, reasoning) == (streamed[0], streamed[2], streamed[4])
    tok = models.load_tokenizer(models.resolve("family:qwen3"))
    text = tok.decode(ids, skip_special_tokens=True)
    # vLLM's qwen3 split: before </think> is reasoning, after it content; all of it while </think> never came
    body = text.removeprefix("<think>")
    if "</think>" in body:
        thought, after = body.split("</think>", 1)
        assert (reasoning or "", (content or "").strip()) == (thought, after.strip())
    else:
        assert (reasoning, content) == (body, None)
    assert reasoning  # a thinking model's reply starts in its reasoning
    # thinking off (enable_thinking false): all content
    content, _, _, _, reasoning = _ask(client, family, seed=3, max_tokens=24)
    assert reasoning is None and content


# ---- one `lightning run` iteration per family ----

AGENT = '''
import json
from openai import OpenAI
import lightning_sdk as ls

TOOLS = {tools}

@ls.rollout
def solve(task, llm):
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    r = client.chat.completions.create(model=llm.model, max_tokens=96, temperature=1.0, tools=TOOLS,
                                       tool_choice={{"type": "function", "function": {{"name": "add"}}}},
                                       messages=[{{"role": "user", "content": task["question"]}}]{extra})
    calls = r.choices[0].message.tool_calls or []
    return json.loads(calls[0].function.arguments) if calls else {{}}

@ls.reward
def score(task, output):
    return float(output.get("a", 0) + output.get("b", 0) == 4) + 0.1 * output.get("a", 0)
'''


# gpt-oss cannot run on vLLM's CPU build (tests/test_vllm_families.py says why: harmony's vocabulary, no MoE-LoRA)
RUNS = [pytest.param(f, "cpu", id=f"{f}-cpu") for f in FAMILIES] + [
    pytest.param(f, "vllm", id=f"{f}-vllm", marks=pytest.mark.vllm) for f in FAMILIES if f != "gpt-oss"]
VLLM_SERVE = 'backend = "vllm"\nsleep_level = 0\nmax_model_len = 2048\n'


@pytest.mark.parametrize(("family", "backend"), RUNS)
def test_one_lightning_run_iteration_per_family_trains(family, backend, tmp_path):
    extra = ', extra_body={"chat_template_kwargs": {"enable_thinking": False}}' if family == "qwen3" else ""
    (tmp_path / "agent.py").write_text(AGENT.format(tools=repr(TOOLS[:1]), extra=extra))
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    (tmp_path / "lightning.toml").write_text(textwrap.dedent(f'''\
        [run]
        name = "one"
        dir = "run"
        iterations = 1
        [agent]
        module = "agent.py"
        [data]
        train = "train.jsonl"
        tasks_per_iteration = 1
        group_size = 4
        [model]
        name = "family:{family}"
        dtype = "float32"
        [rollout]
        concurrency = 4
        timeout = 120.0
        [serve]
        {VLLM_SERVE if backend == "vllm" else ""}
        [train]
        lora_r = 4
        '''))
    Runtime(config.load(tmp_path / "lightning.toml"), console=Console(file=io.StringIO())).run()
    (row,) = [r for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines())
              if "iteration" in r and r.get("phase") != "eval"]
    assert row["train/num_transitions"] == 4 and row["train/constraint_mismatch"] == 0, row
    assert row["train/num_constrained"] == 4 and row["train/grad_norm"] > 0, row
    if backend == "vllm":  # vLLM sampled; the trainer's replay of its grammar gives vLLM's log-probs
        assert row["train/logprob_gap"] < 1e-4, row
