"""Which of vLLM's tool-call and reasoning parsers read a model's output: chosen from the model itself.

vLLM answers 400 to every request with `tools` unless it was started with `--enable-auto-tool-choice
--tool-call-parser NAME`, and leaves a reasoning model's thinking in the content unless started with
`--reasoning-parser NAME`. The right name follows from the format the model was trained to write, which its chat
template shows (the markers it wraps a tool call in) and its config's `model_type` names. A template marker is
the stronger evidence (a Llama-shaped builtin model writes Hermes calls), so it is looked at first.

This module never imports vllm; the names it may choose are config.VLLM_TOOL_CALL_PARSERS / VLLM_REASONING_PARSERS.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning_sdk.constraint import ServerGrammar

# (marker in the chat template, parser): the first that appears wins. Qwen3-Coder's XML calls first: its template
# also holds <tool_call>.
TEMPLATE_TOOL_FORMATS = (
    ("<function=", "qwen3_coder"),  # Qwen3-Coder: <tool_call><function=NAME><parameter=...>
    ("[TOOL_CALLS]", "mistral"),  # Mistral / Mixtral / Ministral
    ("<tool_call>", "hermes"),  # Hermes, Qwen2.5, Qwen3, this project's builtin: and tiny: models
    ("<|python_tag|>", "llama3_json"),  # Llama 3.1 / 3.2 / 3.3
    ("<start_function_call>", "functiongemma"),  # FunctionGemma (a Gemma 3): call:NAME{...} between its tokens
)
# model_type -> parser, for models whose template shows no marker above.
MODEL_TYPE_TOOL_FORMATS = {
    "mistral": "mistral", "mixtral": "mistral", "ministral": "mistral", "llama4": "llama4_pythonic",
    "granite": "granite", "gpt_oss": "openai", "internlm2": "internlm", "jamba": "jamba",
    # Gemma 3 has no tool tokens: Google's function-calling guide and vLLM's Gemma 3 tool template have it answer a
    # Python list of calls, [name(arg=value)], which the pythonic parser reads.
    "gemma3": "pythonic", "gemma3_text": "pythonic",
}
# model_type -> reasoning parser, when the template thinks (<think>) or the family always reasons.
MODEL_TYPE_REASONING = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "openai_gptoss",
                        "deepseek_v3": "deepseek_r1", "granite": "granite"}


def model_files(model: str) -> tuple[str, str]:
    """(chat template, config.json's model_type) of a model directory or a cached hub id; '' where absent."""
    return chat_template(model), str(read_json(model, "config.json").get("model_type") or "")


def chat_template(model: str) -> str:
    jinja = local_file(model, "chat_template.jinja")
    if jinja is not None:
        return jinja.read_text(errors="replace")
    template = read_json(model, "tokenizer_config.json").get("chat_template") or ""
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return str(template)


def read_json(model: str, name: str) -> dict:
    path = local_file(model, name)
    try:
        data = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def local_file(model: str, name: str) -> Path | None:
    """`name` of a model directory, or of a hub id in the local Hugging Face cache (never downloaded here)."""
    if Path(model).is_dir():
        path = Path(model) / name
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(model, name)
    except HFValidationError:  # neither a directory nor a hub id: vLLM will say so when it starts
        return None
    return Path(found) if isinstance(found, str) else None


def tool_call_parser_for(template: str, model_type: str) -> str | None:
    """The vLLM tool-call parser that reads what this model writes; None when nothing known fits."""
    for marker, parser in TEMPLATE_TOOL_FORMATS:
        if marker in template:
            return parser
    if model_type == "llama" and "tools" in template:  # Llama 3.x templates that describe tools in JSON
        return "llama3_json"
    return MODEL_TYPE_TOOL_FORMATS.get(model_type)


def reasoning_parser_for(template: str, model_type: str) -> str | None:
    """The vLLM reasoning parser for a reasoning model (None for others): Qwen3 and gpt-oss by their model type,
    DeepSeek-R1 and its distills (a Qwen2 or Llama shape) by the <think> their template opens."""
    if model_type in MODEL_TYPE_REASONING and (not model_type.startswith("qwen3") or "<think>" in template):
        return MODEL_TYPE_REASONING[model_type]
    return "deepseek_r1" if "<think>" in template else None


def choose(setting: str, detected: str | None) -> str | None:
    """serve.tool_call_parser / serve.reasoning_parser applied: 'auto' = what the model says, 'none' = no parser,
    a name = that parser."""
    if setting == "auto":
        return detected
    return None if setting == "none" else setting


def server_grammar(model: str, tool_setting: str = "auto", reasoning_setting: str = "auto", *,
                   compact: bool) -> ServerGrammar:
    """What a server started on `model` with serve.tool_call_parser = `tool_setting` and serve.reasoning_parser =
    `reasoning_setting` applies to a constraint (`compact`: the built-in server's compact tool-call arguments; vLLM's
    take free whitespace): the one definition both backends are started from and the gateway records."""
    template, model_type = model_files(model)
    return ServerGrammar(choose(tool_setting, tool_call_parser_for(template, model_type)),
                         choose(reasoning_setting, reasoning_parser_for(template, model_type)), compact)
