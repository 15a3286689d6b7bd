"""The remote runtime's protocol (docs/remote.md) on a real gateway, the real CPU server and a real store: a
rollout run with raw HTTP and OTLP JSON by a process that never imports lightning_sdk; the same spans giving the
same transitions over OTLP as in process; the key on every route; malformed bodies refused with nothing stored;
spans of rollouts not claimed now refused and counted."""

from __future__ import annotations

import asyncio
import gzip
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from google.rpc.status_pb2 import Status
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

import lightning_sdk as ls
from lightning_sdk import tracing
from lightning_sdk.rollouts.remote.protocol import Result
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.store import Store
from lightning_sdk.tracing.ship import RolloutShipper
from lightning_sdk.transitions import to_transitions

from .remote_harness import KEY, Api, job

HERE = Path(__file__).parent
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture()
def api(server, tmp_path):
    a = Api(server, Store(tmp_path / "server.sqlite"))
    yield a
    a.stop()
    a.store.close()


def _otlp_json(rollout_id: str, attempt: int = 1, span_id: str = "00f067aa0ba902b7") -> dict:
    attrs = [{"key": "lightning.rollout.id", "value": {"stringValue": rollout_id}},
             {"key": "lightning.rollout.attempt", "value": {"intValue": str(attempt)}}]
    span = {"traceId": "4bf92f3577b34da6a3ce929d0e0e4736", "spanId": span_id, "name": "tool",
            "startTimeUnixNano": "1", "endTimeUnixNano": "2", "attributes": attrs}
    return {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}


def test_a_rollout_with_only_raw_http_and_otlp_json(api, tmp_path):
    task = {"question": "What is 2 + 3?", "answer": "5"}
    api.queue([job(0, task)])
    out = subprocess.run([sys.executable, str(HERE / "remote_raw_worker.py"), api.url, KEY], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    sent = json.loads(out.stdout)
    assert sent["imported_lightning_sdk"] is False
    assert sent["model"] == api.server.served_model_name and sent["again"] == 409  # a second report is refused
    [result] = api.results(1)
    assert result.status == "succeeded" and result.reward == sent["reward"]
    rollout = api.store.rollout("r-0")
    assert rollout.status == "succeeded" and rollout.model == api.server.served_model_name
    [t] = to_transitions(rollout, api.store.spans("r-0"))
    assert list(t.prompt_ids) == sent["prompt_ids"] and list(t.completion_ids) == sent["completion_ids"]
    assert list(t.logprobs) == sent["logprobs"]
    assert (t.component, t.shaping, t.episode_reward) == ("solver", 0.25, sent["reward"])


def test_spans_from_workers_also_reach_the_run_s_otlp_collector(api, tmp_path):
    """run.otlp_endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT) gets a remote worker's spans as it gets local ones."""
    from .test_export import Receiver

    receiver = Receiver()
    tracing.install(Store(tmp_path / "trainer-side.sqlite"), otlp_endpoint=receiver.url)  # the trainer's tracing
    api.queue([job(0, {"question": "What is 2 + 3?", "answer": "5"})])
    out = subprocess.run([sys.executable, str(HERE / "remote_raw_worker.py"), api.url, KEY], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    api.results(1)
    tracing.flush(exporters=True)
    stored = api.store.spans("r-0")
    got = receiver.by_rollout()["r-0"]
    assert sorted(s["span_id"] for s in got) == sorted(s.span_id for s in stored) and len(stored) == 2
    call = next(s for s in got if "lightning.llm.completion_token_ids" in s["attributes"])
    assert call["name"].startswith("chat ")  # the gen_ai name, as the run's own LLM spans are exported
    assert call["attributes"]["lightning.llm.completion_token_ids"] == next(
        s for s in stored if s.span_id == call["span_id"]).attributes["lightning.llm.completion_token_ids"]


def _agent():
    tool = trace.get_tracer("tools")

    @ls.rollout
    async def agent(task, llm):
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            with ls.component("planner"):
                plan = await client.chat.completions.create(
                    model="gpt-4o-mini", max_tokens=4, temperature=0.9,
                    messages=[{"role": "user", "content": task["question"]}])
            ls.emit_reward(0.25, name="format")
            try:
                with tool.start_as_current_span("lookup"):
                    raise KeyError("no such table")  # a failed tool: error_reward for the planner's call
            except KeyError:
                pass
            with ls.component("writer"):
                stream = await client.chat.completions.create(
                    model="gpt-4o-mini", max_tokens=4, stream=True,
                    messages=[{"role": "user", "content": plan.choices[0].message.content or "?"}])
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return text

    @ls.reward
    def score(task, output):
        return 0.5

    return agent, score


def test_otlp_spans_give_exactly_the_in_process_transitions(api, tmp_path):
    """One process, both outlets on the same spans: the store in process, and the OTLP exporter to the server."""
    local = Store(tmp_path / "local.sqlite")
    shipper = RolloutShipper(OTLPSpanExporter(endpoint=f"{api.url}/v1/traces", headers=AUTH,
                                              compression=Compression.Gzip))
    tracing.install(local, outlets=[shipper])
    tracing.request_token_ids_from(api.gateway.base_url)
    jobs = [job(k, {"question": f"What is {k} + 4?"}, prefix="eq") for k in range(4)]
    api.queue(jobs)
    assert [api.dispatch.claim_now("eq").job for _ in jobs] == jobs  # the server's rows, started
    agent, score = _agent()
    llm = ls.LLM(base_url=api.gateway.base_url, api_key=KEY, model="tiny")

    async def phase():
        return await asyncio.gather(*(run_rollout(j, rollout_fn=agent, reward_fn=score, llm=llm, store=local,
                                                  timeout=60) for j in jobs))

    results = asyncio.run(phase())
    tracing.flush()
    assert all(shipper.deliver(j.rollout_id, 30) for j in jobs)
    for r in results:
        assert api.dispatch.finish(r.job.rollout_id, Result(worker="eq", status=r.status, reward=r.reward,
                                                             output=r.output))
    compared = 0
    for j in jobs:
        here, there = local.spans(j.rollout_id), api.store.spans(j.rollout_id)
        assert len(here) == len(there) == 4  # two LLM calls, the reward, the failed tool
        assert here == there  # every field of every span record, the name included
        for kw in ({}, {"components": ["writer"]}, {"failed_reward": -2.0, "error_reward": -0.5}):
            a = to_transitions(local.rollout(j.rollout_id), here, **kw)
            b = to_transitions(api.store.rollout(j.rollout_id), there, **kw)
            assert a == b and a
            compared += len(a)
        [planner, writer] = to_transitions(api.store.rollout(j.rollout_id), there)
        assert (planner.component, planner.shaping, writer.component) == ("planner", 0.25 - 1.0, "writer")
        assert planner.logprobs and len(planner.logprobs) == len(planner.completion_ids) and planner.temperature == 0.9
    assert compared == 4 * 5
    assert api.dispatch.spans_refused == {}
    shipper.shutdown()


ROUTES = [("GET", "/v1/run", None), ("POST", "/v1/work/claim", {"worker": "w"}),
          ("POST", "/v1/work/r-0/result", {"worker": "w", "status": "failed"}),
          ("POST", "/v1/traces", _otlp_json("r-0")), ("POST", "/v1/chat/completions", {"model": "m", "messages": []}),
          ("GET", "/v1/models", None)]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_every_route_needs_the_token(api, headers):
    api.queue([job(0, {"question": "?"})])
    for method, path, body in ROUTES:
        r = httpx.request(method, api.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.status_code)
    assert api.dispatch.counts() == (1, 0) and api.store.count("rollouts") == 0 and api.store.count("spans") == 0


def test_malformed_bodies_get_4xx_and_store_nothing(api):
    api.queue([job(0, {"question": "?"})])
    post = lambda path, **kw: httpx.post(api.url + path, headers={**AUTH, **kw.pop("headers", {})}, timeout=30, **kw)  # noqa: E731
    for body in (b"not json", b'{"worker": ""}', b'{"worker": "w", "extra": 1}', b"[]"):
        r = post("/v1/work/claim", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], body
    assert post("/v1/work/claim", json={"worker": "w"}).status_code == 200
    row = api.store.rollout("r-0")
    for body, field in ((b'{"worker": "w", "status": "succeeded", "reward": NaN}', "reward"),
                        (b'{"worker": "w", "status": "succeeded", "reward": "1"}', "reward"),
                        (b'{"worker": "w", "status": "succeeded"}', "reward"),
                        (b'{"worker": "w", "status": "done", "reward": 1}', "status"),
                        (b'{"worker": "w", "status": "failed", "failed_in": "agent"}', "failed_in")):
        r = post("/v1/work/r-0/result", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)
    assert post("/v1/work/r-0/result", content=b"x" * 300_000).status_code == 413
    assert api.store.rollout("r-0") == row and api.dispatch.counts() == (0, 1)  # still running, still claimed

    good = json.dumps(_otlp_json("r-0")).encode()
    for body, ctype, encoding, status in (
            (b"\x0a\xff\xff garbage", "application/x-protobuf", None, 400),
            (b"{not json", "application/json", None, 400),
            (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": 7}]}]}]}', "application/json", None, 400),
            (b'{"resourceSpans": {"a": 1}}', "application/json", None, 400),
            (good, "text/plain", None, 415),
            (gzip.compress(good)[:-8], "application/json", "gzip", 400),
            (gzip.compress(b" " * 400_000 + good), "application/json", "gzip", 413),
            (b" " * 300_000 + good, "application/json", None, 413)):
        headers = {"Content-Type": ctype, **({"Content-Encoding": encoding} if encoding else {})}
        r = post("/v1/traces", content=body, headers=headers)
        assert r.status_code == status, (body[:40], r.status_code, r.text)
        if ctype == "application/x-protobuf":
            message = Status()
            message.ParseFromString(r.content)
            assert "not a valid protobuf" in message.message
        elif status != 415:
            assert json.loads(r.content)["message"]
    assert api.store.count("spans") == 0
    assert post("/v1/traces", json=_otlp_json("r-0")).json() == {}  # the same span, well formed: taken
    assert api.store.count("spans") == 1


def test_spans_for_rollouts_not_claimed_now_are_refused_and_counted(api):
    api.queue([job(0, {"question": "?"}), job(1, {"question": "?"})])
    post = lambda body: httpx.post(f"{api.url}/v1/traces", json=body, headers=AUTH, timeout=30).json()  # noqa: E731
    assert post(_otlp_json("r-0")) == {"partialSuccess": {"rejectedSpans": "1", "errorMessage": (
        "1 span(s) for a rollout not claimed now (unknown, finished or abandoned)")}}  # queued, not claimed yet
    api.dispatch.claim_now("w")
    api.dispatch.claim_now("w")
    assert post(_otlp_json("r-0")) == {}
    assert post(_otlp_json("r-1", attempt=2, span_id="00f067aa0ba902b8"))["partialSuccess"]["rejectedSpans"] == "1"
    assert api.dispatch.finish("r-0", Result(worker="w", status="failed", error="boom"))
    r = httpx.post(f"{api.url}/v1/work/r-0/result", json={"worker": "w", "status": "failed"}, headers=AUTH)
    assert r.status_code == 409 and "ignored" in r.json()["error"]["message"]
    assert post(_otlp_json("r-0", span_id="00f067aa0ba902b9"))["partialSuccess"]["rejectedSpans"] == "1"  # finished
    assert post(_otlp_json("nobody", span_id="00f067aa0ba902ba"))["partialSuccess"]["rejectedSpans"] == "1"
    assert api.store.count("spans") == 1
    assert sum(api.dispatch.spans_refused.values()) == 4
    assert api.dispatch.spans_refused["for another attempt of their rollout"] == 1


def _otlp_protobuf(rollout_id: str, span_id: str) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(
        trace_id=bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736"), span_id=bytes.fromhex(span_id), name="tool",
        start_time_unix_nano=1, end_time_unix_nano=2)
    span.attributes.add(key="lightning.rollout.id").value.string_value = rollout_id
    span.attributes.add(key="lightning.rollout.attempt").value.int_value = 1
    return request.SerializeToString()


def test_a_gzip_body_of_several_members_stores_every_span(api):
    """Over HTTP: a body of two gzip members (two exports concatenated, as `cat a.gz b.gz` makes) stores both
    exports' spans; two JSON documents so joined are refused whole. Never some spans dropped and 200."""
    api.queue([job(0, {"question": "?"})])
    api.dispatch.claim_now("w")
    post = lambda body, ctype: httpx.post(f"{api.url}/v1/traces", content=body, timeout=30, headers={  # noqa: E731
        **AUTH, "Content-Type": ctype, "Content-Encoding": "gzip"})
    ids = ("00f067aa0ba902b7", "00f067aa0ba902b8")
    r = post(b"".join(gzip.compress(json.dumps(_otlp_json("r-0", span_id=s)).encode()) for s in ids),
             "application/json")
    assert r.status_code == 400 and "not a valid OTLP JSON" in r.json()["message"]
    assert api.store.count("spans") == 0
    r = post(b"".join(gzip.compress(_otlp_protobuf("r-0", s)) for s in ids), "application/x-protobuf")
    assert r.status_code == 200
    assert sorted(s.span_id for s in api.store.spans("r-0")) == list(ids)
