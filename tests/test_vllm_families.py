"""Each real family on vLLM (its CPU build in CI), started as a run starts it (servers/select.vllm_server) behind the
run's gateway: the family's tool-call and reasoning parsers chosen from the model, tool calls under tool_choice
auto / required / named (plain and streamed) parsed and recorded with the exact sampled ids, structured output,
and the trainer's log-probs equal to the server's. The models are `family:NAME` (models.families): random weights
in each family's own architecture and chat format.

One server per family (a module-scoped parametrized fixture: pytest runs a family's tests together, then stops its
server). Random weights rarely write a well-formed call of their own, so the parse checks use forced calls (vLLM
constrains them) and tool_choice auto checks the record only.
"""

from __future__ import annotations

import json

import httpx
import pytest

from lightning_sdk import config, models
from lightning_sdk.tracing import COMPLETION_IDS, PROMPT_IDS

from .conftest import SERVED, gateway_in_front_of, in_rollout, recorded_calls

pytestmark = pytest.mark.vllm

# family -> (tool-call parser, reasoning parser) vLLM is started with.
PARSERS = {"qwen2.5": ("hermes", None), "qwen3": ("hermes", "qwen3"), "llama3": ("llama3_json", None),
           "mistral": ("mistral", None), "gemma3": ("pythonic", None), "gpt-oss": ("openai", "openai_gptoss")}
# The arguments are bounded (an enum and small integers), so a forced call ends well inside max_tokens.
PARAMETERS = {"type": "object", "properties": {"op": {"type": "string", "enum": ["add", "mul"]},
                                               "a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["op", "a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Add or multiply two numbers.",
                                           "parameters": PARAMETERS, "strict": True}}]
MESSAGES = [{"role": "system", "content": "Solve the problem. Use the calculator, then give the number."},
            {"role": "user", "content": "Ann has 12 boxes with 8 pencils in each. How many pencils does Ann have?"}]
NAMED = {"type": "function", "function": {"name": "calculator"}}
# vLLM's tool-call grammars allow any whitespace between JSON tokens, which random weights draw often: a forced call
# takes some hundred tokens to end.
FORCED_TOKENS = 600
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["answer"], "additionalProperties": False}}}


# What a request adds for a family: Qwen3 thinks first unless told not to, and vLLM constrains a forced call or a
# response_format only after the reasoning ends, which random weights rarely write; thinking is checked on its own.
NO_THINKING = {"qwen3": {"chat_template_kwargs": {"enable_thinking": False}}}
# vLLM renders gpt-oss's chat with openai_harmony (the o200k_harmony vocabulary, bundled in its oss-harmony wheel),
# never with the model's chat template or tokenizer: a model whose vocabulary is not those 201,088 ids gets ids it
# does not have.
HARMONY = "gpt-oss"


@pytest.fixture(scope="module", params=sorted(PARSERS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(family) -> str:
    return models.resolve(f"family:{family}")


@pytest.fixture(scope="module")
def tokenizer_of(model_path):
    return models.load_tokenizer(model_path)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    from lightning_sdk.servers.select import vllm_server

    work = tmp_path_factory.mktemp("vllm")
    cfg = config.parse({"agent": {"module": "agent.py"}, "data": {"train": "t.jsonl"},
                        "model": {"name": SERVED, "dtype": "float32"},
                        # generous: vLLM's start on a busy 2-core machine; 30-70 s quiet
                        "serve": {"backend": "vllm", "sleep_level": 0, "max_model_len": 2048, "startup_timeout": 900},
                        "run": {"dir": str(work / "run")}})
    with vllm_server(cfg, model_path, work / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway_server(server):
    with gateway_in_front_of(server) as g:
        yield g


def test_the_server_runs_the_family_s_parsers(server, family):
    cmd = server.command()
    tools, reasoning = PARSERS[family]
    assert cmd[cmd.index("--tool-call-parser") + 1] == tools and "--enable-auto-tool-choice" in cmd
    assert (cmd[cmd.index("--reasoning-parser") + 1] if "--reasoning-parser" in cmd else None) == reasoning


def chat(gw, **body) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/chat/completions", headers={"Authorization": f"Bearer {gw.api_key}"},
                      json={"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 48, "temperature": 1.0,
                            "return_token_ids": True, **body}, timeout=300)


def replies(r: httpx.Response, stream: bool) -> dict[int, dict]:
    """Choice index -> {"ids", "calls": [(name, arguments)], "finish"} of a chat reply, streamed or not."""
    if not stream:
        return {c["index"]: {"ids": c["token_ids"], "finish": c["finish_reason"],
                             "calls": [(t["function"]["name"], t["function"]["arguments"])
                                       for t in c["message"].get("tool_calls") or []]}
                for c in r.json()["choices"]}
    out: dict[int, dict] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                got = out.setdefault(c["index"], {"ids": [], "finish": None})
                got["ids"] += c.get("token_ids") or []
                got["finish"] = c.get("finish_reason") or got["finish"]
                for t in c["delta"].get("tool_calls") or []:
                    slot = calls.setdefault(c["index"], {}).setdefault(t["index"], ["", ""])
                    slot[0] += (t.get("function") or {}).get("name") or ""
                    slot[1] += (t.get("function") or {}).get("arguments") or ""
    for i, got in out.items():
        got["calls"] = [tuple(v) for _, v in sorted(calls.get(i, {}).items())]
    return out


def assert_recorded(gw, store, rid: str, ids: list[int], tokenizer, tools=TOOLS, messages=MESSAGES,
                    template_kwargs: dict | None = None) -> None:
    """The gateway's record of the rollout's one call holds the sampled ids and the prompt the template renders."""
    (call,) = recorded_calls(gw, store, rid)
    assert call.attributes[COMPLETION_IDS] == ids and ids
    assert call.attributes[PROMPT_IDS] == list(tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, **(template_kwargs or {}))["input_ids"])


def chat_family(family: str) -> None:
    if family == HARMONY:
        pytest.skip("vLLM renders gpt-oss's chat in the o200k_harmony vocabulary, not the model's "
                    "(test_gpt_oss_chat_is_rendered_in_harmony_s_vocabulary)")


@pytest.mark.parametrize("body", [
    {"tool_choice": "required"},
    {"tool_choice": "required", "stream": True},
    {"tool_choice": NAMED},
    {"tool_choice": NAMED, "stream": True},
], ids=["required", "required-streamed", "named", "named-streamed"])
def test_a_forced_call_is_parsed_and_recorded_with_exact_ids(gw, store, tokenizer_of, family, body, request):
    """vLLM constrains a forced call to the tool's schema ("strict"): every sample is one call of the calculator
    whose arguments are the schema's, and the record keeps every sampled token the parser turned into it."""
    chat_family(family)
    if family == "llama3" and body["tool_choice"] == "required":
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "vLLM's 'required' grammar for llama3_json lets the model write on after its call, and the parser drops "
            "every call when any later {...} it finds has no \"name\" (KeyError): random text sometimes holds one")))
    if family == "mistral" and body["tool_choice"] == "required" and body.get("stream"):
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "vLLM 0.32's streamed mistral parser sometimes hands a call's arguments back with a separator it read "
            "before them (':{\"op\": ...}', once in a CI run on random weights); the whole reply reads right")))
    extra = NO_THINKING.get(family, {})
    rid = f"r-{family}-{request.node.callspec.id}"
    with in_rollout(gw, rid):
        r = chat(gw, tools=TOOLS, n=2, seed=3, max_tokens=FORCED_TOKENS, **extra, **body)
    assert r.status_code == 200, r.text
    got = replies(r, bool(body.get("stream")))
    assert sorted(got) == [0, 1]
    for reply in got.values():
        said = (reply, tokenizer_of.decode(reply["ids"], skip_special_tokens=False))
        names = [name for name, _ in reply["calls"]]
        # "required" asks for one call or more, a named tool for exactly one
        assert names and set(names) == {"calculator"} and (len(names) == 1 or body["tool_choice"] == "required"), \
            said
        whole = reply["calls"]
        if body["tool_choice"] == "required" and reply["finish"] == "length":  # calls, until max_tokens cut one
            whole = whole[:-1]
        else:
            assert reply["finish"] in ("stop", "tool_calls"), said
        for _, arguments in whole:
            args = json.loads(arguments)
            assert set(args) == {"op", "a", "b"} and args["op"] in ("add", "mul"), args
            assert all(isinstance(args[k], int) and 0 <= args[k] <= 99 for k in ("a", "b")), args
    assert_recorded(gw, store, rid, got[0]["ids"], tokenizer_of, template_kwargs=extra.get("chat_template_kwargs"))


@pytest.mark.parametrize("stream", [False, True], ids=["auto", "auto-streamed"])
def test_tool_choice_auto_is_recorded_with_exact_ids(gw, store, tokenizer_of, family, stream):
    """The model's own text, sampled from random weights: whatever the parser made of it, the record is every
    sampled token."""
    chat_family(family)
    rid = f"r-{family}-auto-{stream}"
    with in_rollout(gw, rid):
        r = chat(gw, tools=TOOLS, seed=5, stream=stream)
    assert r.status_code == 200, r.text
    got = replies(r, stream)
    assert all(name == "calculator" for name, _ in got[0]["calls"])
    assert_recorded(gw, store, rid, got[0]["ids"], tokenizer_of)


def test_structured_output_is_served_and_recorded(gw, store, tokenizer_of, family):
    chat_family(family)
    extra = NO_THINKING.get(family, {})
    rid = f"r-{family}-json"
    with in_rollout(gw, rid):
        r = chat(gw, response_format=SCHEMA, max_tokens=24, seed=7, **extra)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert 0 <= json.loads(choice["message"]["content"])["answer"] <= 999
    assert_recorded(gw, store, rid, choice["token_ids"], tokenizer_of, tools=None,
                    template_kwargs=extra.get("chat_template_kwargs"))


def test_qwen3_s_reasoning_is_split_off_and_dropped_from_the_next_prompt(gw, store, tokenizer_of, family):
    """vLLM's qwen3 reasoning parser moves what comes before </think> into `reasoning`; the record keeps every
    sampled id; sent back in the history before a new question, the template rebuilds the turn without it."""
    if family != "qwen3":
        pytest.skip("Qwen3 alone thinks among the families served here")
    with in_rollout(gw, "r-think"):
        r = chat(gw, max_tokens=24, seed=1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # vLLM's detokenizer holds back the bytes of a character not yet whole: compared without a trailing U+FFFD
    text = tokenizer_of.decode(choice["token_ids"], skip_special_tokens=True)
    thought, closed, answer = text.partition("</think>")
    reasoning, content = (choice["message"]["reasoning"] or ""), (choice["message"]["content"] or "")
    assert reasoning.rstrip("\ufffd") == thought.removeprefix("<think>").strip("\n").rstrip("\ufffd")
    assert content.rstrip("\ufffd") == (answer.lstrip("\n") if closed else "").rstrip("\ufffd")
    assert reasoning  # random weights: the reply never ends its thinking within 24 tokens, or thinks first
    assert_recorded(gw, store, "r-think", choice["token_ids"], tokenizer_of, tools=None)
    thinking = "I add twelve eights."
    history = MESSAGES + [{"role": "assistant", "content": "96", "reasoning_content": thinking},
                          {"role": "user", "content": "And 3 boxes?"}]
    with in_rollout(gw, "r-think-next"):
        r = chat(gw, messages=history, max_tokens=4, seed=1)
    assert r.status_code == 200, r.text
    (call,) = recorded_calls(gw, store, "r-think-next")
    prompt = tokenizer_of.decode(call.attributes[PROMPT_IDS])
    assert "<|im_start|>assistant\n96<|im_end|>" in prompt and thinking not in prompt


def test_gpt_oss_chat_is_rendered_in_harmony_s_vocabulary(gw, family):
    """Why the chat checks do not run for gpt-oss: vLLM turns its messages into o200k_harmony ids (200008 is
    <|message|> there), whatever the model's own tokenizer says."""
    if family != HARMONY:
        pytest.skip("gpt-oss alone is rendered by openai_harmony")
    r = chat(gw, max_tokens=4)
    assert r.status_code == 400 and "Token id 200008 is out of vocabulary" in r.text, r.text


def test_the_trainer_s_log_probs_are_the_server_s(gw, model_path, family):
    """The trainer's model (loaded as the trainer loads it) scores vLLM's samples with the log-probs vLLM
    reported: the family's architecture (sliding windows, sinks, experts, norms) computes the same on both."""
    import torch

    if family == HARMONY:
        pytest.skip("vLLM serves an MoE model with LoRA enabled (as a run starts it) through its Triton MoE-LoRA "
                    "kernel, which its CPU build lacks: the engine dies at the first forward (module "
                    "'triton.language' has no attribute 'float32')")
    model = models.load_causal_lm(model_path, dtype="float32")
    gaps = []
    for seed in range(4):
        r = chat(gw, max_tokens=32, seed=seed, logprobs=True)
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        prompt, ids = body["prompt_token_ids"], choice["token_ids"]
        served = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids).unsqueeze(1))[:, 0]
        assert len(ids) == len(served) and len(prompt) > 64  # past the sliding window of the families that have one
        gaps.append((mine - served).abs())
    gap = torch.cat(gaps)
    print(f"{family}: mean |trainer - vLLM| log-prob {gap.mean():.2e} (max {gap.max():.2e}) over {len(gap)} tokens")
    assert gap.mean() <= 1e-4 and gap.max() <= 1e-3
