"""Real OpenAI-client calls to the real built-in server are captured as spans, with exact token ids, in SQLite."""

import asyncio
import threading

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
