"""A trace id is no key: a call that names a worker's rollout by its trace id (traceparent, baggage, or the
per-rollout URL without the claim's secret) is recorded as a call of no rollout, never trained under it. Only the
claim holder's calls, which carry its secret (the worker's propagation, or the claim's own base URL), are."""

from __future__ import annotations

import httpx
from opentelemetry import baggage, context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import lightning_sdk as ls
from lightning_sdk import tracing
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.remote.protocol import Claim
from lightning_sdk.store import Store
from lightning_sdk.tracing.context import PROPAGATOR, ROLLOUT_KEY

from .remote_harness import KEY, Api, job

AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 2}


def _w3c(trace_id: str, *, in_baggage: bool = False) -> dict[str, str]:
    """W3C headers naming `trace_id`: as the traceparent, or (under a trace of its own) in baggage."""
    own = trace_id if not in_baggage else "ab" * 16
    span = NonRecordingSpan(SpanContext(int(own, 16), 0x1234, is_remote=False, trace_flags=TraceFlags(1)))
    ctx = trace.set_span_in_context(span, context.Context())
    if in_baggage:
        ctx = baggage.set_baggage(ROLLOUT_KEY, trace_id, ctx)
    headers: dict[str, str] = {}
    PROPAGATOR.inject(headers, context=ctx)
    return headers


def test_another_claim_s_trace_id_does_not_attribute_a_call(server, tmp_path):
    api = Api(server, Store(tmp_path / "server.sqlite"))
    try:
        api.queue([job(0, {"question": "?"}), job(1, {"question": "?"})])
        mine = Claim.model_validate(httpx.post(f"{api.url}/v1/work/claim", json={"worker": "a"}, headers=AUTH,
                                               timeout=30).json())
        theirs = Claim.model_validate(httpx.post(f"{api.url}/v1/work/claim", json={"worker": "b"}, headers=AUTH,
                                                 timeout=30).json())
        agents = {"Authorization": f"Bearer {theirs.llm.api_key}"}
        root = f"{api.url}/v1/chat/completions"
        attempts = {  # what a worker holding `mine` can learn of `theirs`: its trace id (in every OTLP export)
            "traceparent": (root, _w3c(theirs.trace_id)),
            "baggage": (root, _w3c(theirs.trace_id, in_baggage=True)),
            "rollout URL without the secret": (f"{api.url}/rollouts/{theirs.trace_id}/v1/chat/completions", {}),
            "rollout URL with my secret": (f"{api.url}/rollouts/{theirs.trace_id}.{mine.secret}/v1/chat/completions",
                                           {}),
            "traceparent with my secret": (root, {**_w3c(theirs.trace_id), "x-lightning-claim": mine.secret}),
        }
        ids = {}
        for what, (url, headers) in attempts.items():
            r = httpx.post(url, json=BODY, headers={**agents, **headers}, timeout=60)
            assert r.status_code == 200, (what, r.text)
            ids[what] = r.headers["x-lightning-call-id"]
        # The holder's own calls: its claim's URL, and its trace id with its secret (a worker's propagation)
        for what, (url, headers) in {"claim URL": (f"{theirs.llm.base_url}/chat/completions", {}),
                                     "propagation": (root, {**_w3c(theirs.trace_id),
                                                            "x-lightning-claim": theirs.secret})}.items():
            r = httpx.post(url, json=BODY, headers={**agents, **headers}, timeout=60)
            assert r.status_code == 200, (what, r.text)
            ids[what] = r.headers["x-lightning-call-id"]
        assert api.gateway.capture.flush()
        stored = {s.span_id: s.rollout_id for s in api.store.spans(theirs.rollout_id)}
        assert set(stored) == {ids["claim URL"], ids["propagation"]}, (stored, ids)
        assert api.gateway.capture.unattributed == len(attempts)
    finally:
        api.stop()
        api.store.close()


def test_a_worker_s_rollout_calls_carry_its_claim_s_secret(server, tmp_path):
    """`run_rollout` with a claim (what `lightning worker` runs): an agent calling the run's root URL, with the
    OpenAI client, is attributed by its propagation (traceparent + the claim's secret)."""
    api = Api(server, Store(tmp_path / "server.sqlite"))
    try:
        api.queue([job(0, {"question": "?"})])
        claim = Claim.model_validate(httpx.post(f"{api.url}/v1/work/claim", json={"worker": "a"}, headers=AUTH,
                                                timeout=30).json())
        sink = Store(tmp_path / "worker.sqlite")
        tracing.install(sink, gateway_url=f"{api.url}/v1")

        @ls.rollout
        async def agent(task, llm):
            import openai

            async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key=llm.api_key, max_retries=0) as c:
                out = await c.chat.completions.create(**BODY)
            return out.choices[0].message.content

        import asyncio

        llm = ls.LLM(base_url=claim.llm.base_url, api_key=claim.llm.api_key, model="m")
        result = asyncio.run(run_rollout(claim.job(), rollout_fn=agent, reward_fn=lambda task, output: 1.0, llm=llm,
                                         store=sink, timeout=60, claim=claim.secret))
        assert result.status == "succeeded", result.error
        assert api.gateway.capture.flush()
        assert [s.source for s in api.store.spans(claim.rollout_id)] == ["gateway"]
        assert api.gateway.capture.unattributed == 0
    finally:
        api.stop()
        api.store.close()
