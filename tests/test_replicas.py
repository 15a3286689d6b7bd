"""serve.replicas: two built-in CPU servers behind the run's gateway (servers/replicas.py, gateway/routing.py), made
by make_server from the config as a run makes them, started once for this module. Calls spread over both, every
adapter is in each replica before a call is routed to it, and a replica that dies is taken out with one line while
the other keeps serving, then comes back once restarted."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from lightning_sdk import config, models, tracing
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.replicas import ReplicaSet
from lightning_sdk.servers.select import make_server
from lightning_sdk.tracing.records import COMPLETION_IDS, POLICY

from .conftest import in_rollout, recorded_calls

ASK = [{"role": "user", "content": "2+2="}]


@pytest.fixture(scope="module")
def replicas(tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    cfg = config.parse({"run": {"dir": str(tmp / "run")}, "agent": {"module": "agent"},
                        "data": {"train": "t.jsonl"}, "model": {"name": "builtin:tiny-arith"},
                        "serve": {"replicas": 2}})
    servers = make_server(cfg, tiny_model_path, tmp / "server.log")
    assert isinstance(servers, ReplicaSet) and len(servers.replicas) == 2
    servers.start()
    gateway = Gateway(api_key="agents")
    gateway.start(servers.urls, backend_key=servers.api_key)
    gateway.policy = servers.served_model_name
    yield servers, gateway
    gateway.stop()
    servers.stop()


def adapter(path, seed: int):
    """A LoRA adapter of the tiny model whose outputs differ from the base's (lora_B perturbed)."""
    from peft import LoraConfig, get_peft_model

    base = models.load_causal_lm(models.resolve("builtin:tiny-arith"))
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(path)
    return str(path)


def served_names(server) -> set[str]:
    r = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    return {m["id"] for m in r.json()["data"]}


def calls(gateway, n: int) -> list[str]:
    """n calls at once through the gateway, as an agent makes them; the model each reply names."""
    async def go():
        async with AsyncOpenAI(base_url=gateway.base_url, api_key="agents", max_retries=0) as client:
            out = await asyncio.gather(*(client.chat.completions.create(model="gpt-4o-mini", messages=ASK,
                                                                         max_tokens=4) for _ in range(n)))
        return [o.model for o in out]

    return asyncio.run(go())


def test_calls_spread_over_both_replicas_each_holding_the_one_adapter_version_served(replicas, tmp_path, store):
    servers, gateway = replicas
    tracing.install(store, gateway_url=gateway.base_url)
    gateway.capture.record_to(store)
    base = servers.served_model_name
    try:
        for version, previous in ((1, None), (2, "run-iter1")):
            name = f"run-iter{version}"
            servers.load_adapter(name, adapter(tmp_path / name, seed=version))
            # In every replica once the load returns: a call routed to it now finds it wherever it goes.
            assert all(name in served_names(r) for r in servers.replicas)
            gateway.policy = name
            if previous:
                servers.unload_adapter(previous)
            assert [served_names(r) for r in servers.replicas] == [{base, name}] * 2
            before = list(gateway.backends.served)
            with in_rollout(gateway, f"r-{version}"):
                assert calls(gateway, 8) == [name] * 8
            spread = [a - b for a, b in zip(gateway.backends.served, before)]
            assert sum(spread) == 8 and min(spread) >= 2, spread  # least-loaded: both take calls
            records = recorded_calls(gateway, store, f"r-{version}")
            assert len(records) == 8 and {r.attributes[POLICY] for r in records} == {name}
            assert all(r.attributes[COMPLETION_IDS] for r in records)  # the record, whichever replica served it
            ports = {r.attributes["server.port"] for r in records}  # and which replica that was
            assert ports == {int(u.rsplit(":", 1)[1]) for u in gateway.backends.urls}, ports
    finally:
        gateway.capture.record_to(None)
        gateway.policy = base


def test_a_replica_that_dies_is_taken_out_with_one_line_and_calls_keep_being_served(replicas, caplog):
    servers, gateway = replicas
    gateway.backends.retry_s = 0.5
    dead = servers.replicas[1]
    os.kill(dead._proc.pid, signal.SIGKILL)
    dead._proc.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="lightning_sdk"):
        for _ in range(3):
            assert calls(gateway, 4) == [servers.served_model_name] * 4  # every call served, none failed
    lines = [r.getMessage() for r in caplog.records if "rotation" in r.getMessage()]
    assert lines == [f"gateway: the inference server at {dead.url} refuses connections; taken out of the rotation "
                     f"(tried again every 0.5 s)"]
    assert not servers.answers()
    servers.restart({})  # what the runtime does when it finds a replica down: that one only
    assert servers.answers()
    time.sleep(0.6)
    before = gateway.backends.served[1]
    with caplog.at_level(logging.WARNING, logger="lightning_sdk"):
        calls(gateway, 4)
    assert gateway.backends.served[1] > before
    assert any("back in the rotation" in r.getMessage() for r in caplog.records)
