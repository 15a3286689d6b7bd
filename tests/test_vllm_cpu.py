"""The vLLM lane (`pytest -m vllm`, .ci/run): what agents send, served by real vLLM (its CPU build in CI) as a run
starts it (servers/select.vllm_server), behind the run's gateway, recorded with the exact sampled token ids.

One vLLM server for the whole module (a start is 30-70 s on 2 cores): the calc cookbook's tiny model, taught to
call its calculator in the Hermes `<tool_call>` format. The capture tests of tests/test_capture.py that do not
depend on the backend run here too, against this server (imported below: pytest collects them with this module's
fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from lightning_sdk import config, models
from lightning_sdk.tracing import COMPLETION_IDS, PROMPT_IDS
from lightning_sdk.tracing.records import POLICY

from .conftest import SERVED, gateway_in_front_of, in_rollout, recorded_calls
from .test_capture import (  # noqa: F401  (collected here: the same assertions against vLLM)
    test_a_litellm_agent_is_recorded, test_a_raw_httpx_post_requests_post_and_aiohttp_agent_are_recorded,
    test_a_sync_call_is_recorded_with_exact_token_ids, test_async_streamed_and_raw_response_calls_are_recorded,
    test_the_completions_api_is_served_and_recorded_plain_and_streamed)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * / and parentheses, e.g. 12*3-5.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
MESSAGES = [{"role": "system", "content": "Solve the problem. Use the calculator, then give the number."},
            {"role": "user", "content": "Ann has 12 boxes with 8 pencils in each. How many pencils does Ann have?"}]
NAMED = {"type": "function", "function": {"name": "calculator"}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    return models.resolve(f"tiny:{ROOT / 'cookbook/calc/teacher.py'}")


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    from lightning_sdk.servers.select import vllm_server

    work = tmp_path_factory.mktemp("vllm")
    cfg = config.parse({"agent": {"module": "agent.py"}, "data": {"train": "t.jsonl"},
                        "model": {"name": SERVED, "dtype": "float32"},
                        # generous: vLLM's start on a busy 2-core machine; 30-70 s quiet
                        "serve": {"backend": "vllm", "sleep_level": 0, "max_model_len": 1024, "startup_timeout": 900},
                        "run": {"dir": str(work / "run")}})
    with vllm_server(cfg, tiny_model_path, work / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway_server(server):
    with gateway_in_front_of(server) as g:
        yield g


def test_parser_names_are_vllms():
    """config validates serve.*_parser against these lists without importing vllm."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from lightning_sdk.config import VLLM_REASONING_PARSERS as REASONING_PARSERS
    from lightning_sdk.config import VLLM_TOOL_CALL_PARSERS as TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(ToolParserManager.list_registered())
    assert set(REASONING_PARSERS) == set(ReasoningParserManager.list_registered())


def test_the_server_was_started_with_the_model_s_tool_call_parser(server):
    cmd = server.command()
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in cmd


def chat(gw, **body) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/chat/completions", headers={"Authorization": f"Bearer {gw.api_key}"},
                      json={"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **body},
                      timeout=300)


def choices(r: httpx.Response, stream: bool) -> dict[int, tuple[list[int], list[tuple[str, str]]]]:
    """Choice index -> (token ids, [(tool name, arguments)]) of a chat reply, streamed or not."""
    if not stream:
        return {c["index"]: (c["token_ids"], [(t["function"]["name"], t["function"]["arguments"])
                                             for t in c["message"].get("tool_calls") or []])
                for c in r.json()["choices"]}
    ids: dict[int, list[int]] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
                for t in c["delta"].get("tool_calls") or []:
                    slot = calls.setdefault(c["index"], {}).setdefault(t["index"], ["", ""])
                    slot[0] += (t.get("function") or {}).get("name") or ""
                    slot[1] += (t.get("function") or {}).get("arguments") or ""
    return {i: (ids[i], [tuple(v) for _, v in sorted(calls.get(i, {}).items())]) for i in ids}


def finish_reasons(r: httpx.Response, stream: bool) -> dict[int, str]:
    """Choice index -> why its sampling stopped ("length": cut at max_tokens)."""
    if not stream:
        return {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
    return {c["index"]: c["finish_reason"] for line in r.text.splitlines() if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"] if c.get("finish_reason")}


@pytest.mark.parametrize("body", [
    {"tools": TOOLS},
    {"tools": TOOLS, "stream": True},
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": NAMED},
    {"tools": TOOLS, "tool_choice": NAMED, "stream": True},
], ids=["auto", "auto-streamed", "required", "named", "named-streamed"])
def test_every_tool_call_form_is_parsed_and_recorded_with_exact_ids(gw, store, tokenizer_of, body, request):
    """Four samples each; with tool_choice unset (auto) whether to call is the model's choice, a call held to the
    tool's schema once `<tool_call>` begins it (the calc model calls its calculator in about half of its answers),
    and vLLM's hermes parser reads it. vLLM's CPU sampling is not the same on every machine, so in that case which
    samples call, and whether a call is whole, is the sample's; what must hold is that the record keeps every
    sampled token, whatever the parser made of them."""
    rid = f"r-{request.node.callspec.id}"
    with in_rollout(gw, rid):
        r = chat(gw, return_token_ids=True, n=4, temperature=1.0, seed=3, **body)
    assert r.status_code == 200, r.text
    got = choices(r, bool(body.get("stream")))
    assert sorted(got) == [0, 1, 2, 3]
    called = [calls for _, calls in got.values() if calls]
    if "tool_choice" in body:  # vLLM constrains these: every sample is a call, whole unless max_tokens cut it
        assert len(called) == 4 and all(name == "calculator" for calls in called for name, _ in calls)
        cut = {i for i, reason in finish_reasons(r, bool(body.get("stream"))).items() if reason == "length"}
        assert all("expression" in json.loads(arguments) for i, (_, calls) in got.items() if i not in cut
                   for _, arguments in calls)
        assert all(arguments.startswith('{"expression"') or '{"expression"'.startswith(arguments)  # a prefix
                   for i, (_, calls) in got.items() if i in cut for _, arguments in calls)
    else:  # the model's own text, sampled: it may call or not, and a call may be cut at max_tokens or malformed
        for ids, calls in got.values():
            assert all(name == "calculator" for name, _ in calls)
            assert not calls or "<tool_call>" in tokenizer_of.decode(ids)
    (call,) = recorded_calls(gw, store, rid)
    # Every sampled token, whatever vLLM moved into tool_calls: the record is the reply's own ids.
    assert call.attributes[COMPLETION_IDS] == got[0][0] and got[0][0]
    assert call.attributes[PROMPT_IDS] == list(tokenizer_of.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True)["input_ids"])


def test_response_format_json_schema_is_served_and_recorded(gw, store):
    with in_rollout(gw, "r-json"):
        r = chat(gw, response_format=SCHEMA, return_token_ids=True, max_tokens=24)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["answer"], int)
    (call,) = recorded_calls(gw, store, "r-json")
    assert call.attributes[COMPLETION_IDS] == choice["token_ids"]


def test_a_hot_loaded_adapter_serves_the_next_call(gw, store, server, tiny_model_path, tmp_path):
    import torch

    from lightning_sdk.config import TrainConfig
    from lightning_sdk.train.trainer import GRPOTrainer

    trainer = GRPOTrainer(tiny_model_path, TrainConfig(lora_r=8, target_modules="all-linear", device="cpu"))
    with torch.no_grad():
        for p in trainer.params:  # a visibly non-zero adapter
            p.normal_(std=0.05)
    trainer.save_adapter(tmp_path / "adapter")
    server.load_adapter("calc-iter1", str(tmp_path / "adapter"))
    gw.policy = "calc-iter1"
    try:
        with in_rollout(gw, "r-adapter"):
            r = chat(gw, return_token_ids=True)
    finally:
        gw.policy = SERVED
    assert r.status_code == 200, r.text
    (call,) = recorded_calls(gw, store, "r-adapter")
    assert call.attributes[POLICY] == "calc-iter1" and call.attributes[COMPLETION_IDS] == \
        r.json()["choices"][0]["token_ids"]
    plain = chat(gw, return_token_ids=True).json()["choices"][0]["token_ids"]
    assert plain != r.json()["choices"][0]["token_ids"]  # greedy: the adapter changed what was sampled
    server.unload_adapter("calc-iter1")


def test_reasoning_left_out_for_the_agent_is_still_recorded(gw, store):
    """include_reasoning=false reaches vLLM as true (else it drops the ids and log-probs); the agent's copy is
    stripped here."""
    with in_rollout(gw, "r-reasoning"):
        r = chat(gw, include_reasoning=False, return_token_ids=True, stream=True)
    assert r.status_code == 200, r.text
    ids = choices(r, True)[0][0]
    (call,) = recorded_calls(gw, store, "r-reasoning")
    assert ids and call.attributes[COMPLETION_IDS] == ids


def test_responses_api_plain_and_streamed_with_tools_are_recorded(gw, store):
    """The Responses API (the Agents SDK's default) over vLLM, through the gateway's shim: the output token ids it
    returns are the record's."""
    c = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    with in_rollout(gw, "r-resp"):
        plain = c.responses.create(model="gpt-4o-mini", input=MESSAGES[1]["content"], tools=tools,
                                   max_output_tokens=40)
        events = list(c.responses.create(model="gpt-4o-mini", input=MESSAGES[1]["content"], tools=tools,
                                         max_output_tokens=40, stream=True))
    assert plain.status in ("completed", "incomplete") and plain.output
    final = events[-1].response  # response.completed, or response.incomplete when max_output_tokens cut it
    assert events[-1].type in ("response.completed", "response.incomplete")
    first, second = recorded_calls(gw, store, "r-resp")
    assert first.attributes["lightning.llm.api"] == second.attributes["lightning.llm.api"] == "responses"
    assert first.attributes[COMPLETION_IDS] == plain.model_extra["output_token_ids"]
    assert second.attributes[COMPLETION_IDS] == final.model_extra["output_token_ids"]


@pytest.fixture(scope="module")
def tokenizer_of(tiny_model_path):
    return models.load_tokenizer(tiny_model_path)


def test_plain_chat_through_the_openai_client(gw):
    out = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0).chat.completions.create(
        model="anything", messages=MESSAGES, max_tokens=8)
    assert out.choices[0].message.content is not None or out.choices[0].message.tool_calls
