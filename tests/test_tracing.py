"""Real OpenAI-client calls to the real built-in server are captured as spans, with exact token ids, in SQLite."""

import asyncio
import threading
import time
import traceback

import openai
import pytest

import lightning_sdk as ls
from lightning_sdk import tracing
from lightning_sdk.tracing import COMPLETION_IDS, COMPLETION_LOGPROBS, COMPONENT, PROMPT_IDS

from .conftest import SERVED

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "EMPTY")


def llm_spans(store, rid):
    tracing.flush()
    return [s for s in store.spans(rid) if s.name != tracing.REWARD_SPAN]


def template_ids(tiny_model_path, messages):
    from lightning_sdk.models import load_tokenizer

    tok = load_tokenizer(tiny_model_path)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def test_sync_call_is_a_span_with_exact_token_ids(server, store, tiny_model_path):
    with tracing.rollout_context("r-sync", attempt=2), ls.component("writer"):
        out = client(server).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=6, logprobs=True)
    (span,) = llm_spans(store, "r-sync")
    a = span.attributes
    assert a[PROMPT_IDS] == out.model_extra["prompt_token_ids"] == template_ids(tiny_model_path, MESSAGES)
    assert a[COMPLETION_IDS] == out.choices[0].model_extra["token_ids"] and len(a[COMPLETION_IDS]) >= 1
    assert a[COMPLETION_LOGPROBS] == pytest.approx([t.logprob for t in out.choices[0].logprobs.content])
    assert a[COMPONENT] == "writer" == span.component and span.attempt == 2 and span.rollout_id == "r-sync"
    assert a["gen_ai.request.model"] == SERVED and a["gen_ai.usage.output_tokens"] == len(a[COMPLETION_IDS])
    assert "What is 2 + 3?" in str(a)  # the instrumentor recorded the prompt text too
    # ...and got through the whole response: it fails (silently, at a cost) on a usage without prompt_tokens_details
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert span.status != "ERROR" and span.end_ns >= span.start_ns


def test_async_call_is_captured(server, store):
    async def go():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        with tracing.rollout_context("r-async"):
            return await c.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=4)

    out = asyncio.run(go())
    (span,) = llm_spans(store, "r-async")
    assert span.attributes[COMPLETION_IDS] == out.choices[0].model_extra["token_ids"]


def test_streamed_call_is_captured_with_exact_ids(server, store):
    with tracing.rollout_context("r-stream"):
        stream = client(server).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=6, stream=True,
                                                        logprobs=True)
        chunks = list(stream)
    ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    prompt = next(c.model_extra["prompt_token_ids"] for c in chunks if c.model_extra.get("prompt_token_ids"))
    (span,) = llm_spans(store, "r-stream")
    assert ids and span.attributes[COMPLETION_IDS] == ids
    assert span.attributes[PROMPT_IDS] == prompt
    assert len(span.attributes[COMPLETION_LOGPROBS]) == len(ids)


def test_async_stream_is_captured(server, store):
    async def go():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        with tracing.rollout_context("r-astream"):
            stream = await c.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5, stream=True)
            return [ch async for ch in stream]

    chunks = asyncio.run(go())
    ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    (span,) = llm_spans(store, "r-astream")
    assert ids and span.attributes[COMPLETION_IDS] == ids


def test_raw_response_call_is_captured(server, store):
    with tracing.rollout_context("r-raw"):
        raw = client(server).chat.completions.with_raw_response.create(model=SERVED, messages=MESSAGES, max_tokens=4)
    out = raw.parse()
    (span,) = llm_spans(store, "r-raw")
    assert span.attributes[COMPLETION_IDS] == out.choices[0].model_extra["token_ids"]


def test_calls_outside_a_rollout_are_not_stored(server, store):
    client(server).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
    tracing.flush()
    assert store.count("spans") == 0


def test_failed_call_is_an_error_span(server, store):
    with tracing.rollout_context("r-err"), pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="no-such-model", messages=MESSAGES)
    (span,) = llm_spans(store, "r-err")
    assert span.status == "ERROR" and COMPLETION_IDS not in span.attributes


def test_emit_reward_is_stored_in_the_rollout(server, store):
    with tracing.rollout_context("r-rew"):
        client(server).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
        ls.emit_reward(-0.5, name="format")
    tracing.flush()
    assert [(r["name"], r["value"]) for r in store.rewards("r-rew")] == [("format", -0.5)]


def test_concurrent_rollouts_keep_their_own_spans(server, store):
    """Async tasks and threads interleave; every span still lands in the rollout that made it."""
    async def agent(rid, c):
        with tracing.rollout_context(rid):
            for k in range(3):
                with ls.component(f"role{k}"):
                    await c.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)

    async def go():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        await asyncio.gather(*(agent(f"a{i}", c) for i in range(12)))

    def threaded(rid):
        with tracing.rollout_context(rid):
            client(server).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)

    threads = [threading.Thread(target=threaded, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    asyncio.run(go())
    for t in threads:
        t.join()
    tracing.flush()
    for i in range(12):
        assert [s.component for s in llm_spans(store, f"a{i}")] == ["role0", "role1", "role2"]
    for i in range(4):
        assert len(llm_spans(store, f"t{i}")) == 1
    assert store.count("spans") == 12 * 3 + 4


def _traced_both_ways(server, store, monkeypatch, rid, **request):
    """The same call traced twice: made beneath the instrumentor and replayed through it on the span writer thread
    (what a plain call inside a rollout gets), and traced by the instrumentor live."""
    from lightning_sdk.tracing import calls

    tracing.request_token_ids_from(server.base_url)  # as the runtime does
    spans = {}
    for way in ("replayed", "live"):
        if way == "live":
            monkeypatch.setattr(calls, "_recordable", lambda args, kwargs: False)
        with tracing.rollout_context(f"{rid}-{way}"), ls.component("solver"):
            t0 = time.time_ns()
            try:
                client(server).chat.completions.create(**request)
            except openai.APIError:
                pass
            t1 = time.time_ns()
        (spans[way],) = llm_spans(store, f"{rid}-{way}")
        assert t0 <= spans[way].start_ns <= spans[way].end_ns <= t1  # the call's own times
    assert tracing.writer_errors() == []
    return spans["replayed"], spans["live"]


def test_a_call_replayed_on_the_writer_thread_is_the_span_the_instrumentor_makes_live(server, store, monkeypatch):
    request = dict(model=SERVED, messages=MESSAGES, max_tokens=4, temperature=0.0, seed=7,
                   tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    replayed, live = _traced_both_ways(server, store, monkeypatch, "r-same", **request)
    per_call = {tracing.ROLLOUT_ID, "gen_ai.response.id"}
    assert {k: v for k, v in replayed.attributes.items() if k not in per_call} == \
        {k: v for k, v in live.attributes.items() if k not in per_call}
    assert replayed.attributes[COMPLETION_IDS] and replayed.attributes["gen_ai.request.temperature"] == 0.0
    assert (replayed.name, replayed.status, replayed.events) == (live.name, live.status, live.events)


def test_a_failed_call_replayed_is_the_error_span_the_instrumentor_makes_live(server, store, monkeypatch):
    replayed, live = _traced_both_ways(server, store, monkeypatch, "r-fail", model="no-such-model", messages=MESSAGES)
    assert replayed.status == live.status == "ERROR" and replayed.status_message == live.status_message
    assert {k: v for k, v in replayed.attributes.items() if k != tracing.ROLLOUT_ID} == \
        {k: v for k, v in live.attributes.items() if k != tracing.ROLLOUT_ID}
    (event,), (live_event,) = replayed.events, live.events
    for key in ("exception.type", "exception.message", "exception.escaped"):
        assert event["attributes"][key] == live_event["attributes"][key]
    assert "NotFoundError" in event["attributes"]["exception.stacktrace"]


def test_the_agent_gets_the_reply_and_the_exception_it_would_get_untraced(server, store):
    tracing.request_token_ids_from(server.base_url)  # as the runtime does: tracing asks for log-probs
    with tracing.rollout_context("r-reply"):
        out = client(server).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3)
        with pytest.raises(openai.NotFoundError) as failed:
            client(server).chat.completions.create(model="no-such-model", messages=MESSAGES)
    # Tracing asked the server for log-probs; the agent did not, and gets none. The span has them.
    assert out.choices[0].logprobs is None
    (span, _) = sorted(llm_spans(store, "r-reply"), key=lambda s: s.start_ns)
    assert len(span.attributes[COMPLETION_LOGPROBS]) == len(span.attributes[COMPLETION_IDS]) >= 1
    # The error was traced by re-raising it through the instrumentor: its traceback is the call's own.
    frames = [f.name for f in traceback.extract_tb(failed.value.__traceback__)]
    assert "create" in frames and not {"_replay", "_replayed", "_fail"} & set(frames)


def test_a_call_under_a_span_the_application_does_not_sample_is_stored(server, store):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    app = TracerProvider(sampler=ALWAYS_OFF).get_tracer("an-agent-framework")
    with tracing.rollout_context("r-unsampled"), app.start_as_current_span("agent step") as step:
        assert not step.get_span_context().trace_flags.sampled
        client(server).chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2)
        ls.emit_reward(0.5)
    (span,) = llm_spans(store, "r-unsampled")
    assert span.trace_id == format(step.get_span_context().trace_id, "032x")  # still a child of the app's span
    assert [r["value"] for r in store.rewards("r-unsampled")] == [0.5]
