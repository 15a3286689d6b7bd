"""Capture at the gateway: every LLM call an agent makes inside a rollout, with any client, is recorded by the
run's gateway with the exact token ids and log-probs the real built-in server produced, under the rollout and
component the agent's context names (W3C traceparent and baggage). Real clients, a real gateway and server on
127.0.0.1, a real SQLite store."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import openai
import pytest
import requests

import lightning_sdk as ls
from lightning_sdk import tracing
from lightning_sdk.tracing import COMPLETION_IDS, COMPLETION_LOGPROBS, COMPONENT, PROMPT_IDS
from lightning_sdk.transitions import to_transitions

from .conftest import SERVED, in_rollout, recorded_calls

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)


def template_ids(tiny_model_path, messages):
    from lightning_sdk.models import load_tokenizer

    tok = load_tokenizer(tiny_model_path)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def _exact(call, tiny_model_path, messages=MESSAGES):
    a = call.attributes
    assert a[PROMPT_IDS] == template_ids(tiny_model_path, messages)
    assert a[COMPLETION_IDS] and len(a[COMPLETION_LOGPROBS]) == len(a[COMPLETION_IDS])
    assert all(lp <= 0 for lp in a[COMPLETION_LOGPROBS]) and call.status == "OK"


def test_a_sync_call_is_recorded_with_exact_token_ids(gw, store, tiny_model_path):
    with in_rollout(gw, "r-sync", attempt=2), ls.component("writer"):
        out = client(gw).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=6, logprobs=True,
                                                 extra_body={"return_token_ids": True})
    (call,) = recorded_calls(gw, store, "r-sync")
    a = call.attributes
    _exact(call, tiny_model_path)
    assert a[PROMPT_IDS] == out.model_extra["prompt_token_ids"]
    assert a[COMPLETION_IDS] == out.choices[0].model_extra["token_ids"]
    assert a[COMPLETION_LOGPROBS] == pytest.approx([t.logprob for t in out.choices[0].logprobs.content])
    assert a[COMPONENT] == "writer" == call.component and call.attempt == 2 and call.rollout_id == "r-sync"
    assert a["gen_ai.request.model"] == "gpt-4o-mini" and a["lightning.llm.policy"] == SERVED
    assert a["gen_ai.usage.output_tokens"] == len(a[COMPLETION_IDS])
    assert "What is 2 + 3?" in a["gen_ai.input.messages"] and out.choices[0].message.content is not None


def test_async_streamed_and_raw_response_calls_are_recorded(gw, store, tiny_model_path):
    async def go():
        c = openai.AsyncOpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
        with in_rollout(gw, "r-async"):
            await c.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=4)
            stream = await c.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    streamed_text = asyncio.run(go())
    with in_rollout(gw, "r-stream"):
        chunks = list(client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=6,
                                                         stream=True, logprobs=True))
        raw = client(gw).chat.completions.with_raw_response.create(model=SERVED, messages=MESSAGES, max_tokens=4)
    first, streamed = recorded_calls(gw, store, "r-async")
    for call in (first, streamed):
        _exact(call, tiny_model_path)
    assert '"content": ' + repr(streamed_text).replace("'", '"') in streamed.attributes["gen_ai.output.messages"]
    sync_stream, plain = recorded_calls(gw, store, "r-stream")
    assert [t.logprob for c in chunks for ch in c.choices for t in (ch.logprobs.content if ch.logprobs else [])] \
        == pytest.approx(sync_stream.attributes[COMPLETION_LOGPROBS])
    assert raw.headers["x-lightning-call-id"] == plain.span_id


def test_calls_outside_a_rollout_are_recorded_as_no_rollout_s(gw, store):
    before = gw.capture.unattributed
    client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
    assert gw.capture.flush()
    assert gw.capture.unattributed == before + 1 and store.count("rollouts") == 0


def test_a_failed_call_is_an_error_record_and_the_agent_gets_the_error(gw, store):
    with in_rollout(gw, "r-err"), pytest.raises(openai.BadRequestError):
        client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=1, n=0)
    (call,) = recorded_calls(gw, store, "r-err")
    assert call.status == "ERROR" and COMPLETION_IDS not in call.attributes and "400" in call.attributes["error.type"]


def test_rewards_and_failed_tools_go_to_the_call_the_agent_had_seen(gw, store):
    from opentelemetry import trace

    tool = trace.get_tracer("tools")
    with in_rollout(gw, "r-rew") as ctx:
        client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
        first = ctx.last_call
        ls.emit_reward(-0.5, name="format")
        client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
        try:
            with tool.start_as_current_span("lookup"):
                raise KeyError("no such table")
        except KeyError:
            pass
    tracing.flush()
    assert [(r["name"], r["value"]) for r in store.rewards("r-rew")] == [("format", -0.5)]
    first_call, second_call = recorded_calls(gw, store, "r-rew")
    assert first == first_call.span_id and ctx.last_call == second_call.span_id
    rollout = _scored(store, "r-rew")
    a, b = to_transitions(rollout, store.spans("r-rew"), error_reward=-1.0)
    assert (a.shaping, b.shaping) == (-0.5, -1.0)


def _scored(store, rid, reward=1.0):
    store.start_rollout(rid, task_id="t", group_id="g", iteration=1, phase="train")
    store.finish_rollout(rid, status="succeeded", reward=reward)
    return store.rollout(rid)


def test_concurrent_rollouts_keep_their_own_calls(gw, store):
    """Async tasks and threads interleave; every call still lands in the rollout that made it."""
    async def agent(rid, c):
        with in_rollout(gw, rid):
            for k in range(3):
                with ls.component(f"role{k}"):
                    await c.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)

    async def go():
        c = openai.AsyncOpenAI(base_url=gw.base_url, api_key=gw.api_key)
        await asyncio.gather(*(agent(f"a{i}", c) for i in range(8)))

    def threaded(rid):
        with in_rollout(gw, rid):
            client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)

    threads = [threading.Thread(target=threaded, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    asyncio.run(go())
    for t in threads:
        t.join()
    for i in range(8):
        assert [s.component for s in recorded_calls(gw, store, f"a{i}")] == ["role0", "role1", "role2"]
    for i in range(4):
        assert len(recorded_calls(gw, store, f"t{i}")) == 1


def test_a_call_under_a_span_that_starts_its_own_unsampled_trace_is_still_the_rollout_s(gw, store):
    from opentelemetry import context as otel_context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    app = TracerProvider(sampler=ALWAYS_OFF).get_tracer("an-agent-framework")
    with in_rollout(gw, "r-unsampled"):
        with app.start_as_current_span("agent step") as step:
            assert not step.get_span_context().trace_flags.sampled
            client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
        # a framework that starts a new trace of its own (a root span): the rollout's baggage entry still names it
        root = app.start_span("new trace", context=trace_root(otel_context.get_current()))
        with tracing_use(root):
            client(gw).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
    child, rooted = recorded_calls(gw, store, "r-unsampled")
    assert child.parent_id == format(step.get_span_context().span_id, "016x")
    assert rooted.trace_id == format(root.get_span_context().trace_id, "032x")


def trace_root(current):
    """The current context without its span (baggage kept): what a framework starting a new trace passes."""
    from opentelemetry import trace

    return trace.set_span_in_context(trace.INVALID_SPAN, current)


def tracing_use(span):
    from opentelemetry import trace

    return trace.use_span(span, end_on_exit=True)


# ------------------------------------------------------------------------- clients we never wrapped by name

def test_a_raw_httpx_post_requests_post_and_aiohttp_agent_are_recorded(gw, store, tiny_model_path):
    body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 3}
    auth = {"Authorization": f"Bearer {gw.api_key}"}
    with in_rollout(gw, "r-httpx"):
        assert httpx.post(f"{gw.base_url}/chat/completions", json=body, headers=auth, timeout=60).status_code == 200
    with in_rollout(gw, "r-requests"):
        assert requests.post(f"{gw.base_url}/chat/completions", json=body, headers=auth, timeout=60).ok

    async def aio():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            with in_rollout(gw, "r-aiohttp"):
                async with session.post(f"{gw.base_url}/chat/completions", json=body, headers=auth) as r:
                    assert r.status == 200

    asyncio.run(aio())
    for rid in ("r-httpx", "r-requests", "r-aiohttp"):
        (call,) = recorded_calls(gw, store, rid)
        _exact(call, tiny_model_path)


def test_requests_to_other_hosts_get_no_rollout_context(gw, store):
    """Only the gateway's address gets traceparent and baggage: nothing leaks to other services."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Echo(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append({k.lower() for k in self.headers})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with in_rollout(gw, "r-leak"):
            httpx.get(f"http://127.0.0.1:{other.server_port}/x", timeout=10)
            requests.get(f"http://127.0.0.1:{other.server_port}/x", timeout=10)
    finally:
        other.shutdown()
    assert len(seen) == 2 and not any({"traceparent", "baggage"} & h for h in seen)


def test_a_litellm_agent_is_recorded(gw, store, tiny_model_path, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    with in_rollout(gw, "r-litellm"), ls.component("solver"):
        out = litellm.completion(model="openai/gpt-4o-mini", messages=MESSAGES, max_tokens=3,
                                 api_base=gw.base_url, api_key=gw.api_key)
    (call,) = recorded_calls(gw, store, "r-litellm")
    _exact(call, tiny_model_path)
    assert call.component == "solver" and out.choices[0].message.content is not None


def test_a_dspy_agent_is_recorded(gw, store, monkeypatch):
    """`dspy.LM(api_base=llm.base_url)` as an agent writes it. DSPy 3.4 sends such a call through its own socket
    transport, which no trace context reaches: the rollout's base URL (what a run's `llm.base_url` is) attributes
    it, as it does through LiteLLM (DSPy 3.0-3.3)."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)  # DSPy 3.4 hands such an LM to LiteLLM
    monkeypatch.delenv("OPENAI_API_BASE", raising=False)
    dspy = pytest.importorskip("dspy")
    with in_rollout(gw, "r-dspy") as ctx:
        lm = dspy.LM("openai/gpt-4o-mini", api_base=gw.rollout_base_url(ctx.trace_id), api_key=gw.api_key,
                     max_tokens=8, cache=False, num_retries=0)
        with dspy.context(lm=lm):
            lm(messages=MESSAGES)
    (call,) = recorded_calls(gw, store, "r-dspy")
    assert call.status == "OK" and call.attributes[COMPLETION_IDS]


# --------------------------------------------------------------------------------- the Responses API

def test_responses_api_calls_are_recorded_plain_and_streamed(gw, store, tiny_model_path):
    c = client(gw)
    with in_rollout(gw, "r-resp"), ls.component("planner"):
        plain = c.responses.create(model="gpt-4o-mini", input="What is 2 + 3?", max_output_tokens=5,
                                   temperature=0.7)
        with c.responses.stream(model="gpt-4o-mini", input="What is 2 + 3?", max_output_tokens=4) as s:
            # Sampled: a reply cut at 4 tokens ends in response.incomplete, as OpenAI's does, which the SDK's
            # get_final_response() refuses; either final event carries the response.
            (final,) = [e.response for e in s if e.type in ("response.completed", "response.incomplete")]
    first, second = recorded_calls(gw, store, "r-resp")
    assert first.attributes["lightning.llm.api"] == second.attributes["lightning.llm.api"] == "responses"
    assert first.attributes["gen_ai.request.temperature"] == 0.7 and first.component == "planner"
    _exact(first, tiny_model_path)
    assert plain.output_text is not None and final.status in ("completed", "incomplete")
    rollout = _scored(store, "r-resp")
    assert len(to_transitions(rollout, store.spans("r-resp"))) == 2


def test_the_per_rollout_base_url_needs_no_opentelemetry(gw, store):
    trace_id = os.urandom(16).hex()
    gw.rollouts.open(trace_id, "r-url", 1, "train")
    try:
        plain = openai.OpenAI(base_url=f"{gw.url}/rollouts/{trace_id}/v1", api_key=gw.api_key)
        plain.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
    finally:
        gw.rollouts.close(trace_id)
    (call,) = recorded_calls(gw, store, "r-url")
    assert call.trace_id == trace_id and call.status == "OK"


def test_the_completions_api_is_served_and_recorded_plain_and_streamed(gw, store, tiny_model_path):
    from lightning_sdk.models import load_tokenizer

    c = client(gw)
    with in_rollout(gw, "r-compl"):
        plain = c.completions.create(model="gpt-3.5-turbo-instruct", prompt="2 + 3 =", max_tokens=4)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="gpt-3.5-turbo-instruct", prompt="2 + 3 =", max_tokens=4, stream=True, logprobs=1) if ch.choices)
    first, second = recorded_calls(gw, store, "r-compl")
    expected = list(load_tokenizer(tiny_model_path)("2 + 3 =")["input_ids"])
    for call in (first, second):
        a = call.attributes
        assert a[PROMPT_IDS] == expected and a["lightning.llm.api"] == "completions"
        assert a[COMPLETION_IDS] and len(a[COMPLETION_LOGPROBS]) == len(a[COMPLETION_IDS])
    assert plain.choices[0].logprobs is None and isinstance(streamed, str)
    assert "prompt_token_ids" not in (plain.choices[0].model_extra or {})
