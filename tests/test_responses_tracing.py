"""Responses API calls (tracing/responses.py) become spans with the exact token ids the server returned, and
transitions exactly as chat calls do: plain, cut short, streamed, async, raw, failed, and from the OpenAI Agents
SDK given only a model name."""

import asyncio
import json
from collections import Counter

import httpx
import openai
import pytest
from opentelemetry import trace

from lightning_sdk import tracing
from lightning_sdk.store import RolloutRecord
from lightning_sdk.tracing import COMPLETION_IDS, COMPLETION_LOGPROBS, PROMPT_IDS
from lightning_sdk.transitions import to_transitions

from .responses_app import BREAK_MIDSTREAM
from .test_responses import QUESTION, RAG_QUESTION, app, rag_app  # noqa: F401  (fixtures)


def client(app, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key=app.api_key, max_retries=0, **kw)


def spans(store, rid):
    tracing.flush()
    return [s for s in store.spans(rid) if s.name != tracing.REWARD_SPAN]


def rollout(rid: str) -> RolloutRecord:
    return RolloutRecord(rollout_id=rid, task_id="t", group_id="0:0", iteration=0, phase="train", attempt=1,
                         model="m", status="succeeded", output="x", reward=1.0, error=None, traceback=None,
                         started_at=0.0, ended_at=1.0)


def assert_ids(span, response: dict) -> None:
    a = span.attributes
    assert a[PROMPT_IDS] == response["prompt_token_ids"] and a[COMPLETION_IDS] == response["output_token_ids"]
    assert a[COMPLETION_LOGPROBS] == pytest.approx(response["output_logprobs"]) and a[COMPLETION_IDS]


def test_call_is_one_span_current_during_the_call_and_a_transition(app, store):
    seen = []  # the span current while the request goes out
    http = openai.DefaultHttpxClient(event_hooks={"request": [lambda r: seen.append(trace.get_current_span())]})
    with tracing.rollout_context("resp-plain"):
        raw = client(app, http_client=http).responses.with_raw_response.create(
            model="gpt-4o-mini", input=QUESTION, instructions="Be brief.", max_output_tokens=20, temperature=0.7,
            extra_body={"seed": 11})
    body = json.loads(raw.text)
    (span,) = spans(store, "resp-plain")
    assert_ids(span, body)
    assert format(seen[0].get_span_context().span_id, "016x") == span.span_id
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "gpt-4o-mini"
    assert a["gen_ai.response.id"] == body["id"] and a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.request.temperature"] == 0.7 and a["gen_ai.usage.output_tokens"] == len(a[COMPLETION_IDS])
    assert QUESTION in a["gen_ai.input.messages"] and "Be brief." in a["gen_ai.input.messages"]
    assert span.status != "ERROR"
    (t,) = to_transitions(rollout("resp-plain"), [span])
    assert list(t.prompt_ids) == body["prompt_token_ids"] and list(t.completion_ids) == body["output_token_ids"]
    assert list(t.logprobs) == pytest.approx(body["output_logprobs"]) and t.temperature == 0.7
    assert t.finish_reason == "stop"


def test_cut_short_response_still_is_a_span_read_as_length(app, store):
    with tracing.rollout_context("resp-cut"):
        r = client(app).responses.create(model="m", input=QUESTION, max_output_tokens=1, extra_body={"seed": 3})
    assert r.status == "incomplete"
    (span,) = spans(store, "resp-cut")
    assert_ids(span, r.model_dump())
    (t,) = to_transitions(rollout("resp-cut"), [span])
    assert t.finish_reason == "length" and len(t.completion_ids) == 1


def test_streamed_calls_are_spans_with_the_final_events_ids(app, store):
    c = client(app)
    with tracing.rollout_context("resp-stream"):
        events = list(c.responses.create(model="m", input=QUESTION, max_output_tokens=20, stream=True,
                                         extra_body={"seed": 11}))
        with c.responses.stream(model="m", input=QUESTION, max_output_tokens=1, extra_body={"seed": 3}) as stream:
            for _ in stream:
                pass
    first, second = spans(store, "resp-stream")
    assert_ids(first, events[-1].response.model_dump())
    assert first.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert second.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert len(second.attributes[COMPLETION_IDS]) == 1
    assert [t.finish_reason for t in to_transitions(rollout("resp-stream"), [first, second])] == ["stop", "length"]


def test_async_calls_are_spans(app, store):
    async def go():
        c = openai.AsyncOpenAI(base_url=app.base_url, api_key=app.api_key, max_retries=0)
        with tracing.rollout_context("resp-async"):
            plain = await c.responses.create(model="m", input=QUESTION, max_output_tokens=8)
            stream = await c.responses.create(model="m", input=QUESTION, max_output_tokens=8, stream=True)
            events = [e async for e in stream]
            async with c.responses.with_streaming_response.create(model="m", input=QUESTION, max_output_tokens=8,
                                                                  stream=True) as raw:
                raw_events = [e async for e in await raw.parse()]
        return plain, events, raw_events

    plain, events, raw_events = asyncio.run(go())
    first, second, third = spans(store, "resp-async")
    assert_ids(first, plain.model_dump())
    assert_ids(second, events[-1].response.model_dump())
    assert_ids(third, raw_events[-1].response.model_dump())


def test_failed_and_abandoned_calls_are_error_spans(app, store):
    c = client(app)
    with tracing.rollout_context("resp-fail"):
        with pytest.raises(openai.BadRequestError):
            c.responses.create(model="m", input=QUESTION, tools=[{"type": "web_search"}])
        stream = c.responses.create(model="m", input=QUESTION, max_output_tokens=20, stream=True)
        next(iter(stream))
        stream.close()  # before its final event: no Response, no sample
        events = list(c.responses.create(model="m", input=QUESTION, user=BREAK_MIDSTREAM, stream=True))
    calls = spans(store, "resp-fail")
    assert [s.status for s in calls] == ["ERROR"] * 3 and events[-1].type == "error"
    assert all(COMPLETION_IDS not in s.attributes and s.attributes["gen_ai.operation.name"] == "chat"
               for s in calls)
    skipped = Counter()
    assert to_transitions(rollout("resp-fail"), calls, skipped=skipped, failed_reward=0.0) == []
    assert skipped["failed_call"] == 3  # failed calls are never trained on


def test_calls_outside_a_rollout_are_not_stored(app, store):
    client(app).responses.create(model="m", input=QUESTION, max_output_tokens=2)
    tracing.flush()
    assert store.count("spans") == 0


def test_registered_endpoints_are_asked_for_token_ids(app, store):
    sent = []
    http = openai.DefaultHttpxClient(event_hooks={"request": [lambda r: sent.append(json.loads(r.read()))]})
    other = app.base_url.replace("127.0.0.1", "localhost")  # the same server under a name nobody registered
    openai.OpenAI(base_url=other, api_key=app.api_key, http_client=http).responses.create(
        model="m", input=QUESTION, max_output_tokens=2)
    tracing.request_token_ids_from(app.base_url)
    client(app, http_client=http).responses.create(model="m", input=QUESTION, max_output_tokens=2)
    assert "return_token_ids" not in sent[0] and sent[1]["return_token_ids"] is True


def test_agents_sdk_agent_given_a_model_name_is_served_and_traced(rag_app, store, monkeypatch):
    """An Agents SDK agent built with only a model name calls /v1/responses on OPENAI_BASE_URL; every call is a span
    with the exact ids of the Response the router made (fetched back by the span's response id)."""
    from agents import Agent, ModelSettings, Runner, function_tool

    monkeypatch.setenv("OPENAI_BASE_URL", rag_app.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", rag_app.api_key)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    searched = []

    @function_tool
    def search(query: str) -> str:
        """Search the encyclopedia; returns the best matching passages."""
        searched.append(query)
        return {"Rentissa": "Rentissa was born in the town of Lomimi."}.get(query, "Lomimi is a town in the region "
                                                                                  "of Quvel.")

    agent = Agent(name="researcher", model="gpt-4o-mini", tools=[search],
                  instructions="Answer with the region name only. Search for the person, then for their town's "
                               "region.",
                  model_settings=ModelSettings(temperature=0))  # greedy: the call the teacher taught, every time
    before = (len(rag_app.chat_bodies), rag_app.chat_calls)

    async def both():  # one event loop: the SDK's default client shares its connections across runs
        plain = await Runner.run(agent, RAG_QUESTION, max_turns=4)
        streamed = Runner.run_streamed(agent, RAG_QUESTION, max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return plain, streamed

    with tracing.rollout_context("resp-agents"):
        result, streamed_result = asyncio.run(both())
    assert isinstance(result.final_output, str) and isinstance(streamed_result.final_output, str)
    assert searched[0] == "Rentissa" and len(searched) >= 2  # it really called its tool, in both runs
    responses_calls = len(rag_app.chat_bodies) - before[0]
    assert responses_calls == rag_app.chat_calls - before[1] > 0  # all through /v1/responses, none to chat
    assert rag_app.gateway.asked["gpt-4o-mini"] >= responses_calls  # the name the agent was given
    calls = spans(store, "resp-agents")
    assert len(calls) == responses_calls
    for span in calls:
        response = httpx.get(f"{rag_app.base_url}/responses/{span.attributes['gen_ai.response.id']}",
                             headers=rag_app.auth).json()
        assert_ids(span, response)
