"""The gateway (gateway/proxy.py): the one address agents call. Any model name is served by the policy being
trained, every response carries token ids, the least-loaded backend takes each request; real CPU servers on
127.0.0.1 and the real openai client."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from lightning_sdk.gateway.proxy import Gateway

ASK = [{"role": "user", "content": "2+2="}]


@pytest.fixture()
def gateway(server):
    g = Gateway(api_key="agents", model_names=())
    g.start([server.url], backend_key=server.api_key)
    g.policy = server.served_model_name
    yield g
    g.stop()


def test_any_model_name_is_served_by_the_policy_and_logged_once(gateway, server, caplog):
    client = OpenAI(base_url=gateway.base_url, api_key="agents", max_retries=0)
    with caplog.at_level(logging.INFO, logger="lightning_sdk"):
        for _ in range(2):
            out = client.chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=3)
            assert out.model == server.served_model_name  # the backend answered as the policy
        client.chat.completions.create(model=server.served_model_name, messages=ASK, max_tokens=3)
    asked = [r.getMessage() for r in caplog.records if "asked for model" in r.getMessage()]
    assert asked == ["the agent asked for model 'gpt-4o-mini': served by the policy being trained (any name is; "
                     "serve.model_names restricts them)"]
    stats = httpx.get(f"{gateway.url}/gateway/stats", headers={"Authorization": "Bearer agents"}).json()
    assert stats["asked"] == {"gpt-4o-mini": 2, server.served_model_name: 1}
    models = client.models.list()
    assert [m.id for m in models.data] == [server.served_model_name]


def test_the_gateway_records_each_call_and_the_agent_gets_only_what_it_asked_for(gateway, server, tmp_path):
    """The record (token ids, log-probs, policy, rollout, component) is made from what the backend sent; the reply
    carries no token ids or log-probs the agent did not ask for, and names the record in x-lightning-call-id."""
    from lightning_sdk.store import Store
    from lightning_sdk.tracing import COMPLETION_IDS, COMPLETION_LOGPROBS, PROMPT_IDS, is_llm_call

    store = Store(tmp_path / "store.sqlite")
    gateway.capture.record_to(store)
    trace_id = "ab" * 16
    gateway.rollouts.open(trace_id, "r-1", 1, "train")
    auth = {"Authorization": "Bearer agents", "traceparent": f"00-{trace_id}-{'cd' * 8}-01",
            "baggage": "lightning.component=writer"}
    body = {"model": "whatever", "messages": ASK, "max_tokens": 4}  # a client that asks for neither
    plain = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=auth, timeout=60)
    reply = plain.json()
    assert "prompt_token_ids" not in reply and "token_ids" not in reply["choices"][0]
    assert reply["choices"][0]["logprobs"] is None
    asked = httpx.post(f"{gateway.base_url}/chat/completions", json={**body, "logprobs": True,
                                                                      "return_token_ids": True},
                       headers=auth, timeout=60).json()
    assert asked["prompt_token_ids"] and asked["choices"][0]["token_ids"] and asked["choices"][0]["logprobs"]
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json={**body, "stream": True}, headers=auth,
                      timeout=60) as s:
        streamed_id = s.headers["x-lightning-call-id"]
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert lines and not any('"token_ids"' in line or '"logprob"' in line for line in lines)
    assert gateway.capture.flush()
    calls = {c.span_id: c for c in store.spans("r-1") if is_llm_call(c)}
    assert len(calls) == 3 and plain.headers["x-lightning-call-id"] in calls and streamed_id in calls
    for call in calls.values():
        a = call.attributes
        assert call.trace_id == trace_id and call.parent_id == "cd" * 8 and call.component == "writer"
        assert a[PROMPT_IDS] and a[COMPLETION_IDS] and len(a[COMPLETION_LOGPROBS]) == len(a[COMPLETION_IDS])
        assert len(a["lightning.llm.completion_tokens"]) == len(a[COMPLETION_IDS])  # streamed too: for the dashboard
        assert a["lightning.llm.policy"] == server.served_model_name and a["gen_ai.request.model"] == "whatever"
        assert a["gen_ai.request.temperature"] == 1.0  # sent explicitly: no backend default decides it
    the_asked = next(c for c in calls.values() if c.attributes[COMPLETION_IDS] == asked["choices"][0]["token_ids"])
    assert the_asked.attributes[PROMPT_IDS] == asked["prompt_token_ids"]
    assert the_asked.attributes[COMPLETION_LOGPROBS] == [t["logprob"] for t in asked["choices"][0]["logprobs"]["content"]]
    assert the_asked.attributes["lightning.llm.completion_tokens"] == [
        t["token"] for t in asked["choices"][0]["logprobs"]["content"]]
    gateway.capture.record_to(None)
    store.close()


def accepted_socket_of(client_address: tuple) -> socket.socket:
    """This process's server-side end of the connection whose client end is at `client_address` (the gateway runs
    in this process): found among the open descriptors, duplicated so closing it leaves the gateway's alone."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername() == client_address:
                return s
        except OSError:
            pass
        s.close()
    raise AssertionError(f"no server-side socket for {client_address}")


def test_replies_on_a_kept_alive_connection_are_not_held_back_by_nagle(gateway):
    """Without TCP_NODELAY on the gateway's side, its reply (headers and body: two writes) waited for the client's
    delayed ACK on every request after a connection's first: ~40 ms a call."""
    host, port = gateway.url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as ours:
        for _ in range(2):  # the second request on the same connection
            ours.sendall(request)
            reply = b""
            while not reply.endswith(b"}"):  # {"status":"ok"}
                reply += ours.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200")
        with accepted_socket_of(ours.getsockname()) as theirs:
            assert theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_model_names_restricts_what_is_served(server):
    g = Gateway(api_key="agents", model_names=["gpt-4o-mini"])
    g.start([server.url], backend_key=server.api_key)
    g.policy = "tiny"
    try:
        client = OpenAI(base_url=g.base_url, api_key="agents", max_retries=0)
        assert client.chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=2).choices
        assert client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices  # the policy's name
        with pytest.raises(openai.NotFoundError, match=r"claude-3.*\['gpt-4o-mini'\] \(serve.model_names\)"):
            client.chat.completions.create(model="claude-3", messages=ASK, max_tokens=2)
        assert [m.id for m in client.models.list().data] == ["tiny", "gpt-4o-mini"]
    finally:
        g.stop()


def test_bad_requests_get_openai_shaped_errors(server):
    g = Gateway(api_key="agents")
    auth = {"Authorization": "Bearer agents", "Content-Type": "application/json"}
    g.start([server.url, "http://127.0.0.1:9"], backend_key=server.api_key)  # backend 1: nothing listens there
    try:
        url = f"{g.base_url}/chat/completions"
        r = httpx.post(url, json={"model": "m", "messages": ASK}, headers=auth, timeout=30)
        assert r.status_code == 503 and "no policy" in r.json()["error"]["message"]  # before the run serves one
        g.policy = "tiny"
        for body, status, words in ((b"{not json", 400, "not valid JSON"), (b"[1, 2]", 400, "JSON object"),
                                    (b'{"messages": []}', 400, "model: expected"), (b'{"model": 7}', 400, "model")):
            r = httpx.post(url, content=body, headers=auth, timeout=30)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert httpx.get(url, headers=auth, timeout=30).status_code == 405  # only POSTs take the calls' own route
        codes = sorted(httpx.post(url, json={"model": "m", "messages": ASK, "max_tokens": 2}, headers=auth,
                                  timeout=30).status_code for _ in range(2))
        assert codes == [200, 200]  # the backend that refuses connections is taken out; the live one serves both
        stats = httpx.get(f"{g.url}/gateway/stats", headers=auth).json()
        assert stats["in_flight"] == [0, 0] and stats["served"] == [2, 0]  # the refused request released its slot
    finally:
        g.stop()


def test_least_loaded_backend_takes_each_request(tiny_model_path, tmp_path):
    from lightning_sdk.servers.cpu import CPUServer

    servers = [CPUServer(tiny_model_path, served_model_name="tiny", threads=1, log_path=tmp_path / f"s{i}.log")
               for i in range(2)]
    for s in servers:
        s.start()
    assert servers[0].api_key is None
    # Backend 0 accepts a request and holds it open: deterministic load, no timing.
    held, release = socket.create_server(("127.0.0.1", 0)), threading.Event()
    conns = []

    def hold():
        while not release.is_set():
            try:
                c, _ = held.accept()
            except OSError:
                return
            conns.append(c)

    threading.Thread(target=hold, daemon=True).start()
    g = Gateway(api_key="agents")
    g.start([f"http://127.0.0.1:{held.getsockname()[1]}", servers[0].url, servers[1].url], backend_key=None)
    g.policy = "tiny"
    auth = {"Authorization": "Bearer agents"}
    try:
        client = OpenAI(base_url=g.base_url, api_key="agents", max_retries=0)
        stats = lambda: httpx.get(f"{g.url}/gateway/stats", headers=auth).json()  # noqa: E731
        stuck = threading.Thread(target=lambda: httpx.post(f"{g.base_url}/chat/completions", timeout=60, headers=auth,
                                                           json={"model": "tiny", "messages": ASK}), daemon=True)
        stuck.start()
        deadline = time.monotonic() + 30
        while stats()["in_flight"] != [1, 0, 0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats()["in_flight"] == [1, 0, 0]
        for stream in (False, True, False):  # the free servers take them, streamed or not, in turn
            r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, stream=stream)
            assert (list(r)[0].choices is not None) if stream else r.choices[0].message.content is not None
        assert stats()["served"] == [1, 2, 1]
        release.set()
        for c in conns:
            c.close()
        held.close()
        stuck.join(timeout=30)
        deadline = time.monotonic() + 30
        while stats()["in_flight"] != [0, 0, 0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats()["in_flight"] == [0, 0, 0]  # a failed upstream releases its slot
    finally:
        g.stop()
        for s in servers:
            s.stop()


def test_ray_servers_load_adapters_on_every_server(tiny_model_path, tmp_path):
    """RayServers sends adapter loads to each server itself (the gateway has no adapter routes)."""
    pytest.importorskip("ray")
    import torch
    from peft import LoraConfig, get_peft_model

    from lightning_sdk import config, models
    from lightning_sdk.rollouts.ray import RayServers
    from lightning_sdk.servers import ServerError
    from lightning_sdk.servers.cpu import CPUServer

    cfg = config.parse({"agent": {"module": "a.py"}, "data": {"train": "t.jsonl"}, "run": {"runtime": "ray"}})
    ray_servers = RayServers(cfg, tiny_model_path, tmp_path)
    servers = [CPUServer(tiny_model_path, served_model_name="tiny", threads=1, api_key=ray_servers.api_key,
                         log_path=tmp_path / f"s{i}.log") for i in range(2)]
    for s in servers:
        s.start()
    ray_servers.urls = [s.url for s in servers]  # what start() gets from the server actors
    auth = {"Authorization": f"Bearer {ray_servers.api_key}"}
    try:
        base = models.load_causal_lm(tiny_model_path)
        peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01)
        peft_model.save_pretrained(tmp_path / "adapter")
        ray_servers.load_adapter("tuned", str(tmp_path / "adapter"))
        for s in servers:
            assert {m["id"] for m in httpx.get(f"{s.base_url}/models", headers=auth).json()["data"]} == {"tiny", "tuned"}
        with pytest.raises(ServerError, match="load_lora_adapter failed"):
            ray_servers.load_adapter("x", "/nope")
        ray_servers.unload_adapter("tuned")
        for s in servers:
            assert {m["id"] for m in httpx.get(f"{s.base_url}/models", headers=auth).json()["data"]} == {"tiny"}
    finally:
        for s in servers:
            s.stop()


def test_a_reply_orjson_refuses_is_relayed_and_recorded_as_the_standard_library_reads_it(tmp_path):
    """The gateway parses and writes back replies with orjson; one holding what orjson does not read (a -Infinity
    log-prob, a lone surrogate) goes through the standard library both ways: the agent gets back what the backend
    sent, less what it did not ask for, and the record keeps it."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from lightning_sdk.gateway.listen import ThreadedServer, bind, url_of
    from lightning_sdk.store import Store
    from lightning_sdk.tracing import COMPLETION_LOGPROBS, is_llm_call

    raw = (b'{"id": "c", "object": "chat.completion", "model": "p", "prompt_token_ids": [1, 2], "choices": [{"index": 0, '
           b'"message": {"role": "assistant", "content": "\\ud800x"}, "finish_reason": "stop", "token_ids": [5, 6], '
           b'"logprobs": {"content": [{"token": "a", "logprob": -Infinity}, {"token": "b", "logprob": -0.5}]}}]}')

    async def chat(request):
        return Response(raw, media_type="application/json")

    sock = bind("127.0.0.1", 0)
    backend = ThreadedServer(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]), sock,
                             name="orjson-refuses")
    backend.start()
    g = Gateway(api_key="agents")
    g.start([url_of(sock)], backend_key=None)
    g.policy = "p"
    store = Store(tmp_path / "store.sqlite")
    g.capture.record_to(store)
    g.rollouts.open("ab" * 16, "r-1", 1, "train")
    auth = {"Authorization": "Bearer agents", "traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    try:
        url, body = f"{g.base_url}/chat/completions", {"model": "m", "messages": ASK}
        plain = json.loads(httpx.post(url, json=body, headers=auth, timeout=30).text)
        assert plain["choices"][0]["message"]["content"] == "\ud800x" and plain["choices"][0]["logprobs"] is None
        assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
        asked = json.loads(httpx.post(url, json={**body, "logprobs": True}, headers=auth, timeout=30).text)
        assert [t["logprob"] for t in asked["choices"][0]["logprobs"]["content"]] == [-math.inf, -0.5]
        assert g.capture.flush()
        calls = [c for c in store.spans("r-1") if is_llm_call(c)]
        assert len(calls) == 2 and all(c.status == "OK" for c in calls)
        assert all(c.attributes[COMPLETION_LOGPROBS] == [-math.inf, -0.5] for c in calls)
    finally:
        g.capture.record_to(None)
        g.stop()
        backend.stop()
        sock.close()
        store.close()
