"""Nobody in without the key: the runtime's inference server (serving/select.make_server) gets a key made for the
run, kept out of argv, and every route but /health refuses a caller without it; the gateway in front (what agents
call, with serve.api_key or a key of its own) too, and the agents' key cannot reach the adapter routes.
An empty serve.api_key is refused at the edge instead of turning authentication off.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from lightning_sdk import cli, config, models
from lightning_sdk.gateway.guard import RefusedRequests
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.select import make_server

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "cookbook/arith/agent.py"
CHAT = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 2}
ADAPTER = {"lora_name": "swap", "lora_path": "/tmp/someone-elses-adapter", "load_inplace": True}


def make_cfg(tmp_path: Path, **serve) -> config.Config:
    return config.parse({"agent": {"module": str(AGENT)}, "data": {"train": str(tmp_path / "train.jsonl")},
                         "run": {"dir": str(tmp_path / "run")}, "serve": {"max_model_len": 128, **serve}})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    cfg = make_cfg(tmp)
    assert cfg.serve.api_key is None
    s = make_server(cfg, models.resolve(cfg.model.name), tmp / "server.log")
    with s:
        yield s


# Every route a caller could use to read or change the server: the OpenAI ones, the adapter swap, the stats.
ROUTES = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/load_lora_adapter", ADAPTER),
          ("POST", "/v1/unload_lora_adapter", {"lora_name": "swap"}), ("GET", "/v1/models", None),
          ("GET", "/stats", None), ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/nowhere", None)]


def assert_refused(base: str, routes, served: str) -> int:
    tried = 0
    for method, route, body in routes:
        if body is CHAT:
            body = {**CHAT, "model": served}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "wrong"}, {"X-Api-Key": "x"}):
            r = httpx.request(method, f"{base}{route}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (route, headers, r.text)
            assert r.json()["error"]["type"] == "AuthenticationError"
            tried += 1
    return tried


def test_the_runtime_s_server_has_a_key_per_run_out_of_argv(tmp_path, server):
    key = server.api_key
    assert isinstance(key, str) and len(key) >= 40  # secrets.token_urlsafe(32)
    other = make_server(make_cfg(tmp_path), "unused", tmp_path / "other.log")
    assert other.api_key and other.api_key != key  # a new one per run
    assert key not in " ".join(server.command())
    pid = server._proc.pid
    assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()  # what `ps` shows
    assert Path(f"/proc/{pid}/environ").read_bytes().count(key.encode()) == 1  # the environment carries it
    # serve.api_key is the gateway's, the agents' key: the backend's (which can swap adapters) is never it
    configured = make_server(make_cfg(tmp_path, api_key="mine"), "unused", tmp_path / "mine.log")
    assert configured.api_key and configured.api_key != "mine"


def test_without_the_key_every_route_but_health_is_401(server):
    tried = assert_refused(server.url, ROUTES, server.served_model_name)
    assert httpx.get(f"{server.url}/health").status_code == 200  # liveness stays open
    auth = {"Authorization": f"Bearer {server.api_key}"}
    r = httpx.post(f"{server.base_url}/chat/completions", json={**CHAT, "model": server.served_model_name},
                   headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"]
    stats = httpx.get(f"{server.url}/stats", headers=auth).json()
    assert stats["adapters"] == []  # nothing was swapped in by the refused load_lora_adapter calls
    print(f"auth: {tried} requests without a valid key, {tried} refused with 401")


def test_500_bad_keys_write_a_bounded_small_amount_of_log(server):
    """A flood of refused requests (serve.host = 0.0.0.0 lets anyone on the network send them) is summarised, a
    line per source per minute, instead of a line each."""
    size = server.log_path.stat().st_size
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for i in range(500):
            r = c.request(*(("GET", "/stats"), ("POST", "/v1/chat/completions"))[i % 2],
                          headers={"Authorization": f"Bearer wrong-{i}"})
            assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # the log is written before this answer
    grown = server.log_path.stat().st_size - size
    assert grown < 1024, server.log_tail(20)
    assert "-> 401 (missing or wrong API key); further refusals from it are counted" in server.log_tail(400)
    print(f"500 bad-key requests wrote {grown} bytes of log")


def test_refusals_are_counted_per_minute_per_source(caplog):
    now = [0.0]
    refused = RefusedRequests(max_sources=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="lightning_sdk.servers"):
        assert refused.note("10.0.0.1", "GET", "/stats") is True  # opens the minute
        for i in range(499):
            assert refused.note("10.0.0.1", "POST", f"/v1/x{i}") is False
        for source in ("10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.3"):
            refused.note(source, "GET", "/")
        assert [r.getMessage() for r in caplog.records] == [
            "GET '/stats' from 10.0.0.1 -> 401 (missing or wrong API key); further refusals from it are counted, "
            "one line a minute",
            "GET '/' from 10.0.0.2 -> 401 (missing or wrong API key); further refusals from it are counted, "
            "one line a minute",
            "GET '/' from other sources -> 401 (missing or wrong API key); further refusals from it are counted, "
            "one line a minute"]
        caplog.clear()
        now[0] = 60.0  # the next minute's first refusal logs the last minute's counts
        assert refused.note("10.0.0.2", "GET", "/") is True
        assert [r.getMessage() for r in caplog.records] == [
            "499 more request(s) from 10.0.0.1 refused with 401 in the last 60s",
            "2 more request(s) from other sources refused with 401 in the last 60s",
            "GET '/' from 10.0.0.2 -> 401 (missing or wrong API key); further refusals from it are counted, "
            "one line a minute"]


def test_the_gateway_checks_its_own_key_and_keeps_adapters_out_of_reach(server):
    gateway = Gateway(api_key="agents-key")
    gateway.start([server.url], backend_key=server.api_key)
    gateway.policy = server.served_model_name
    try:
        routes = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/responses", {"model": "m", "input": "x"}),
                  ("POST", "/v1/load_lora_adapter", ADAPTER), ("GET", "/v1/models", None),
                  ("GET", "/gateway/stats", None), ("GET", "/docs", None)]
        tried = assert_refused(gateway.url, routes, server.served_model_name)
        backend_key = {"Authorization": f"Bearer {server.api_key}"}  # the backend's key is not the gateway's
        assert httpx.post(f"{gateway.base_url}/chat/completions", json={**CHAT, "model": "m"},
                          headers=backend_key, timeout=30).status_code == 401
        assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200
        auth = {"Authorization": "Bearer agents-key"}
        r = httpx.post(f"{gateway.base_url}/chat/completions", json={**CHAT, "model": "any-name",
                                                                     "return_token_ids": True}, headers=auth,
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"]
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # with the agents' key: no such route
            assert httpx.post(f"{gateway.url}{route}", json=ADAPTER, headers=auth, timeout=30).status_code == 404
        stats = httpx.get(f"{server.url}/stats", headers=backend_key).json()
        assert stats["adapters"] == []  # nothing was swapped in
        print(f"gateway auth: {tried} requests without a valid key, {tried} refused with 401")
    finally:
        gateway.stop()


def test_ray_servers_get_a_key_per_run(tmp_path):
    pytest.importorskip("ray")
    from lightning_sdk.rollouts.ray import RayServers

    cfg = make_cfg(tmp_path)
    a, b = RayServers(cfg, "unused", tmp_path), RayServers(cfg, "unused", tmp_path)
    assert a.api_key and b.api_key and a.api_key != b.api_key  # the server actors check it


@pytest.mark.parametrize("value", ['""', '" "', '"k\\u00e9y"', '"two words"'])
def test_an_unusable_serve_api_key_is_one_line_exit_2(tmp_path, value):
    (tmp_path / "train.jsonl").write_text('{"question": "What is 1 + 2?", "answer": "3"}\n')
    (tmp_path / "lightning.toml").write_text(f'[agent]\nmodule = "{AGENT}"\n[data]\ntrain = "train.jsonl"\n'
                                             f'[run]\ndir = "run"\n[serve]\napi_key = {value}\n')
    out = CliRunner().invoke(cli.main, ["run", "-c", str(tmp_path / "lightning.toml")])
    assert out.exit_code == 2, out.output
    assert out.output.startswith("error: ") and "serve.api_key" in out.output
    assert out.output.strip().count("\n") == 0, out.output
    assert not (tmp_path / "run").exists()
