"""The agent side alone, as a worker's light environment has it (no torch, no fastapi): inside a rollout, every
request toward the gateway's address carries the rollout's W3C traceparent and its component's baggage, the
reply's call id becomes the rollout's latest seen call, and rewards name it. A stdlib HTTP server on 127.0.0.1
stands in for the gateway. CI runs this file again in a venv holding the lowest versions pyproject allows."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

import lightning_sdk as ls
from lightning_sdk import tracing
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import AFTER_CALL

REPLY = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "5"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@pytest.fixture()
def fake_gateway():
    seen: list[dict] = []
    exports: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path == "/v1/traces":  # an OTLP collector's route on the same stand-in
                exports.append(self.headers.get("content-type"))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            seen.append({k.lower(): v for k, v in self.headers.items()})
            body = json.dumps(REPLY).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.send_header("x-lightning-call-id", f"call{len(seen)}")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.seen, server.exports = seen, exports
    server.base_url = f"http://127.0.0.1:{server.server_port}/v1"
    yield server
    server.shutdown()


def test_requests_toward_the_gateway_carry_the_rollout_and_component(fake_gateway, tmp_path):
    store = Store(tmp_path / "store.sqlite")
    tracing.install(store, gateway_url=fake_gateway.base_url)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    client = openai.OpenAI(base_url=fake_gateway.base_url, api_key="k", max_retries=0)  # built before the rollout
    with tracing.rollout_context("r-1", trace_id=trace_id) as ctx:
        with ls.component("writer"):
            client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "2+3"}])
        assert ctx.last_call == "call1"
        ls.emit_reward(0.5, name="format")
        httpx.post(f"{fake_gateway.base_url}/chat/completions", json={"model": "m", "messages": []})
        assert ctx.last_call == "call2"
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "outside"}])
    first, second, outside = fake_gateway.seen
    assert first["traceparent"].split("-")[1] == trace_id == second["traceparent"].split("-")[1]
    assert "lightning.component=writer" in first["baggage"]
    assert "lightning.component" not in second.get("baggage", "")
    assert "traceparent" not in outside  # outside a rollout nothing is added
    tracing.flush()
    [reward] = [s for s in store.spans("r-1") if s.name == tracing.REWARD_SPAN]
    assert reward.attributes[AFTER_CALL] == "call1" and reward.trace_id == trace_id
    store.close()


def test_the_async_client_and_threads_that_copy_context_carry_it(fake_gateway, tmp_path):
    import asyncio
    import contextvars

    store = Store(tmp_path / "store.sqlite")
    tracing.install(store, gateway_url=fake_gateway.base_url)

    async def go():
        client = openai.AsyncOpenAI(base_url=fake_gateway.base_url, api_key="k", max_retries=0)
        with tracing.rollout_context("r-2", trace_id="1" * 32):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            ctx = contextvars.copy_context()
            t = threading.Thread(target=ctx.run, args=(lambda: httpx.post(f"{fake_gateway.base_url}/x", json={}),))
            t.start()
            t.join()

    asyncio.run(go())
    assert [h["traceparent"].split("-")[1] for h in fake_gateway.seen] == ["1" * 32] * 2
    store.close()


def test_with_a_collector_a_call_is_exported_once_under_the_rollouts_own_span(fake_gateway, tmp_path):
    """The OpenAI client is not instrumented (its span would repeat the gateway's record of the call): the
    rollout's agent side leaves no span of the call, and the call's traceparent names the rollout's own span."""
    store = Store(tmp_path / "store.sqlite")
    tracing.install(store, gateway_url=fake_gateway.base_url, otlp_endpoint=fake_gateway.base_url.removesuffix("/v1"))
    client = openai.OpenAI(base_url=fake_gateway.base_url, api_key="k", max_retries=0)
    with tracing.rollout_context("r-3") as ctx:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    tracing.flush(exporters=True)
    assert store.spans("r-3") == []
    assert fake_gateway.seen[-1]["traceparent"].split("-")[1:3] == [ctx.trace_id, ctx.span_id]
    tracing.install(store)  # no collector for the tests after this one
    store.close()
