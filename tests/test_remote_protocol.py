"""The remote runtime's protocol (docs/remote.md) on a real gateway, the real CPU server and a real store: a
rollout run with raw HTTP and OTLP JSON by a process that never imports lightning_sdk; the same spans giving the
same transitions over OTLP as in process; the key on every route; malformed bodies refused with nothing stored;
spans of rollouts not claimed now refused and counted."""

from __future__ import annotations

import asyncio
import dataclasses
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
from lightning_sdk.rollouts.remote.ship import RolloutShipper
from lightning_sdk.transitions import to_transitions

from .remote_harness import AGENTS_KEY, KEY, Api, job

HERE = Path(__file__).parent
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture()
def api(server, tmp_path):
    a = Api(server, Store(tmp_path / "server.sqlite"))
    yield a
    a.stop()
    a.store.close()


def _otlp_json(rollout_id: str, attempt: int = 1, span_id: str = "00f067aa0ba902b7", claim: str | None = None,
               reward: object = None) -> dict:
    attrs = [{"key": "lightning.rollout.id", "value": {"stringValue": rollout_id}},
             {"key": "lightning.rollout.attempt", "value": {"intValue": str(attempt)}}]
    if claim is not None:
        attrs.append({"key": "lightning.claim", "value": {"stringValue": claim}})
    if reward is not None:
        # OTLP JSON (protobuf's mapping) writes non-finite doubles as strings: "NaN", "Infinity"
        value = ({"stringValue": reward} if isinstance(reward, str) else
                 {"doubleValue": reward if reward == reward and abs(reward) != float("inf") else str(reward)
                  .replace("nan", "NaN").replace("inf", "Infinity")})
        attrs.append({"key": "lightning.reward.value", "value": value})
    span = {"traceId": "4bf92f3577b34da6a3ce929d0e0e4736", "spanId": span_id,
            "name": "tool" if reward is None else "lightning.reward",
            "startTimeUnixNano": "1", "endTimeUnixNano": "2", "attributes": attrs}
    return {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}


def test_a_rollout_with_only_raw_http_and_otlp_json(api, tmp_path):
    task = {"question": "What is 2 + 3?", "answer": "5"}
    api.queue([job(0, task)])
    out = subprocess.run([sys.executable, str(HERE / "remote_raw_worker.py"), api.url, KEY], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    sent = json.loads(out.stdout)
    assert sent["imported_lightning_sdk"] is False and "/rollouts/" in sent["base_url"]
    assert sent["model"] == api.server.served_model_name and sent["again"] == 409  # a second report is refused
    [result] = api.results(1)
    assert result.status == "succeeded" and result.reward == sent["reward"]
    rollout = api.store.rollout("r-0")
    assert rollout.status == "succeeded" and rollout.model == api.server.served_model_name
    spans = api.store.spans("r-0")
    assert not any("lightning.claim" in s.attributes for s in spans)  # checked, then dropped
    [t] = to_transitions(rollout, spans)  # the gateway's record; the worker's own token ids are never read
    assert t.span_id == sent["call_id"] and min(t.prompt_ids) >= 0 and len(t.logprobs) == len(t.completion_ids)
    assert (t.component, t.shaping, t.episode_reward) == ("solver", 0.25, sent["reward"])


def test_spans_from_workers_also_reach_the_run_s_otlp_collector(api, tmp_path, receiver):
    """run.otlp_endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT) gets a remote worker's spans as it gets local ones, and
    the rollout's root: the span its claim named, exported by the server from the result it accepted."""
    tracing.install(Store(tmp_path / "trainer-side.sqlite"), otlp_endpoint=receiver.url)  # the trainer's tracing
    api.queue([job(0, {"question": "What is 2 + 3?", "answer": "5"})])
    out = subprocess.run([sys.executable, str(HERE / "remote_raw_worker.py"), api.url, KEY], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    api.results(1)
    tracing.flush(exporters=True)
    stored = [s for s in api.store.spans("r-0") if not tracing.is_llm_call(s)]  # the worker's own spans
    got = receiver.by_rollout()["r-0"]
    (root,) = [s for s in got if not s["parent_id"]]
    assert sorted(s["span_id"] for s in got) == sorted([s.span_id for s in stored] + [root["span_id"]])
    assert len(stored) == 2 and all(s["parent_id"] == root["span_id"] for s in got if s is not root)
    # one trace; "rollout": this worker sends no agent name
    assert root["name"] == "invoke_agent rollout" and {s["trace_id"] for s in got} == {root["trace_id"]}
    sent = json.loads(out.stdout)
    assert root["attributes"]["lightning.reward.value"] == sent["reward"] and root["status"] == 1  # OK
    assert (root["attributes"]["lightning.rollout.status"], root["attributes"]["lightning.task.id"]) == ("succeeded", "t0")
    assert not any("lightning.claim" in s["attributes"] for s in got)  # the claim's secret goes nowhere
    reward = next(s for s in got if s["name"] == "lightning.reward")
    assert reward["attributes"]["lightning.reward.value"] == 0.25


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


def test_otlp_spans_give_the_in_process_spans_and_the_gateway_the_calls(api, tmp_path):
    """One process, both outlets on the same spans: the store in process, and the OTLP exporter to the server. The
    server keeps the agent's spans exactly as a local store does, and the gateway's records of the calls beside
    them; rewards and a failed tool are credited to the call the agent had seen."""
    local = Store(tmp_path / "local.sqlite")
    shipper = RolloutShipper(OTLPSpanExporter(endpoint=f"{api.url}/v1/traces", headers=AUTH,
                                              compression=Compression.Gzip))
    tracing.install(local, gateway_url=api.gateway.base_url, outlets=[shipper])
    jobs = [job(k, {"question": f"What is {k} + 4?"}, prefix="eq") for k in range(4)]
    api.queue(jobs)
    claims = [api.dispatch.claim_now("eq") for _ in jobs]
    assert [c.job for c in claims] == jobs  # the server's rows, started
    agent, score = _agent()
    llm = ls.LLM(base_url=api.gateway.base_url, api_key=AGENTS_KEY, model="tiny")

    async def phase():
        return await asyncio.gather(*(run_rollout(c.job, rollout_fn=agent, reward_fn=score, llm=llm, store=local,
                                                  timeout=60, claim=c.secret) for c in claims))

    results = asyncio.run(phase())
    tracing.flush()
    assert all(shipper.deliver(j.rollout_id, 30) for j in jobs)
    for r, c in zip(results, claims):
        assert api.dispatch.finish(r.job.rollout_id, Result(worker="eq", status=r.status, reward=r.reward,
                                                             output=r.output), c.secret)
    assert api.gateway.capture.flush()
    compared = 0
    for j in jobs:
        here, there = local.spans(j.rollout_id), api.store.spans(j.rollout_id)
        mine = [s for s in there if not tracing.is_llm_call(s)]
        assert len(here) == len(mine) == 2  # the reward, the failed tool
        assert [dataclasses.replace(s, attributes={k: v for k, v in s.attributes.items() if k != "lightning.claim"})
                for s in here] == mine  # every other field of every span record, the name included
        assert len(there) == 4 and sum(map(tracing.is_llm_call, there)) == 2  # and the gateway's two calls
        for kw in ({}, {"components": ["writer"]}, {"failed_reward": -2.0, "error_reward": -0.5}):
            compared += len(to_transitions(api.store.rollout(j.rollout_id), there, **kw))
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
    claim = post("/v1/work/claim", json={"worker": "w"})
    assert claim.status_code == 200
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
    well_formed = _otlp_json("r-0", claim=claim.json()["secret"])
    assert post("/v1/traces", json=well_formed).json() == {}  # the same span, well formed: taken
    assert api.store.count("spans") == 1


def test_spans_for_rollouts_not_claimed_now_are_refused_and_counted(api):
    api.queue([job(0, {"question": "?"}), job(1, {"question": "?"})])
    post = lambda body: httpx.post(f"{api.url}/v1/traces", json=body, headers=AUTH, timeout=30).json()  # noqa: E731
    assert post(_otlp_json("r-0")) == {"partialSuccess": {"rejectedSpans": "1", "errorMessage": (
        "1 span(s) for a rollout not claimed now (unknown, finished or abandoned)")}}  # queued, not claimed yet
    first, second = api.dispatch.claim_now("w"), api.dispatch.claim_now("w")
    assert post(_otlp_json("r-0", claim=first.secret)) == {}
    assert post(_otlp_json("r-1", attempt=2, span_id="00f067aa0ba902b8", claim=second.secret)
                )["partialSuccess"]["rejectedSpans"] == "1"
    assert api.dispatch.finish("r-0", Result(worker="w", status="failed", error="boom"), first.secret)
    r = httpx.post(f"{api.url}/v1/work/r-0/result", json={"worker": "w", "status": "failed"}, headers=AUTH)
    assert r.status_code == 409 and "ignored" in r.json()["error"]["message"]
    assert post(_otlp_json("r-0", span_id="00f067aa0ba902b9"))["partialSuccess"]["rejectedSpans"] == "1"  # finished
    assert post(_otlp_json("nobody", span_id="00f067aa0ba902ba"))["partialSuccess"]["rejectedSpans"] == "1"
    assert api.store.count("spans") == 1
    assert sum(api.dispatch.spans_refused.values()) == 4
    assert api.dispatch.spans_refused["for another attempt of their rollout"] == 1


def test_a_claim_is_its_holders_alone(api):
    """Spans or a result for a rollout another worker holds: 403, nothing stored, the holder still reports it.
    The agents' key (every agent's OPENAI_API_KEY) claims nothing; the workers' key calls no LLM route."""
    api.queue([job(0, {"question": "?"})])
    agents = {"Authorization": f"Bearer {AGENTS_KEY}"}
    assert httpx.post(f"{api.url}/v1/work/claim", json={"worker": "agent"}, headers=agents).status_code == 401
    assert httpx.get(f"{api.url}/v1/models", headers=AUTH).status_code == 401
    holder = httpx.post(f"{api.url}/v1/work/claim", json={"worker": "w1"}, headers=AUTH, timeout=30).json()
    thief = {"x-lightning-claim": "guessed"}
    r = httpx.post(f"{api.url}/v1/traces", json=_otlp_json("r-0", claim="guessed", reward=1.0), headers=AUTH)
    assert r.status_code == 403 and "claim" in r.json()["message"]
    r = httpx.post(f"{api.url}/v1/traces", json=_otlp_json("r-0", reward=1.0), headers=AUTH)  # no secret at all
    assert r.status_code == 403
    result = {"worker": "w2", "status": "succeeded", "reward": 1.0}
    r = httpx.post(f"{api.url}/v1/work/r-0/result", json=result, headers={**AUTH, **thief})
    assert r.status_code == 403
    assert api.store.count("spans") == 0 and api.store.rollout("r-0").status == "running"
    r = httpx.post(f"{api.url}/v1/work/r-0/result", json={**result, "worker": "w1", "reward": 0.0},
                   headers={**AUTH, "x-lightning-claim": holder["secret"]})
    assert r.status_code == 200 and api.store.rollout("r-0").reward == 0.0


@pytest.mark.parametrize("sent, field", [
    (b'{"worker": "w", "status": "succeeded", "reward": NaN}', "reward"),
    (b'{"worker": "w", "status": "succeeded", "reward": "abc"}', "reward"),
    (b'{"worker": "w", "status": "succeeded", "reward": 1000001.0}', "reward"),  # past the bound of +-1e6
    (b'{"worker": "w", "status": "succeeded", "reward": 1.7e308}', "reward"),
    (b'{"worker": "w", "status": "failed", "reward": -1e300}', "reward"),
    ("span", "lightning.reward.value"),
    ("nan span", "lightning.reward.value"),
])
def test_a_worker_s_garbage_fails_its_rollout_with_one_line_naming_the_field(api, sent, field):
    api.queue([job(0, {"question": "?"})])
    holder = httpx.post(f"{api.url}/v1/work/claim", json={"worker": "w"}, headers=AUTH, timeout=30).json()
    headers = {**AUTH, "x-lightning-claim": holder["secret"], "Content-Type": "application/json"}
    if isinstance(sent, bytes):
        r = httpx.post(f"{api.url}/v1/work/r-0/result", content=sent, headers=headers)
        assert r.status_code == 400
    else:
        reward = "abc" if sent == "span" else float("nan")
        body = json.dumps(_otlp_json("r-0", claim=holder["secret"], reward=reward)).encode()
        r = httpx.post(f"{api.url}/v1/traces", content=body, headers=headers)
        assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1"
        r = httpx.post(f"{api.url}/v1/work/r-0/result", json={"worker": "w", "status": "succeeded", "reward": 1.0},
                       headers=headers)
        assert r.status_code == 200
    [result] = api.results(1)
    row = api.store.rollout("r-0")
    assert result.status == row.status == "failed" and row.reward is None
    assert field in row.error and "\n" not in row.error, row.error
    assert api.store.count("spans") == 0  # the bad reward span was not stored


def _otlp_protobuf(rollout_id: str, span_id: str, claim: str) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(
        trace_id=bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736"), span_id=bytes.fromhex(span_id), name="tool",
        start_time_unix_nano=1, end_time_unix_nano=2)
    span.attributes.add(key="lightning.rollout.id").value.string_value = rollout_id
    span.attributes.add(key="lightning.rollout.attempt").value.int_value = 1
    span.attributes.add(key="lightning.claim").value.string_value = claim
    return request.SerializeToString()


def test_a_gzip_body_of_several_members_stores_every_span(api):
    """Over HTTP: a body of two gzip members (two exports concatenated, as `cat a.gz b.gz` makes) stores both
    exports' spans; two JSON documents so joined are refused whole. Never some spans dropped and 200."""
    api.queue([job(0, {"question": "?"})])
    secret = api.dispatch.claim_now("w").secret
    post = lambda body, ctype: httpx.post(f"{api.url}/v1/traces", content=body, timeout=30, headers={  # noqa: E731
        **AUTH, "Content-Type": ctype, "Content-Encoding": "gzip"})
    ids = ("00f067aa0ba902b7", "00f067aa0ba902b8")
    r = post(b"".join(gzip.compress(json.dumps(_otlp_json("r-0", span_id=s, claim=secret)).encode()) for s in ids),
             "application/json")
    assert r.status_code == 400 and "not a valid OTLP JSON" in r.json()["message"]
    assert api.store.count("spans") == 0
    r = post(b"".join(gzip.compress(_otlp_protobuf("r-0", s, secret)) for s in ids), "application/x-protobuf")
    assert r.status_code == 200
    assert sorted(s.span_id for s in api.store.spans("r-0")) == list(ids)
