"""One GPU shared in time by `lightning serve` (production/gpu_turn.py): for the learner's update the gateway's door
closes, the calls at the backend finish, the server sleeps, the trainer steps, the server wakes and the calls that
waited are answered. vLLM's sleep mode exists only on CUDA (its CPU build has none), so here the built-in server
stands in for it: `Sleeper` passes everything to the real server and records, when told to sleep and to wake, what
the door said then (its wake waits for the test, which keeps the turn open while a call arrives). The door itself,
the gateway, the server, the store and the update are the real ones."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import openai
import pytest

from lightning_sdk.gateway.door import Door
from lightning_sdk.production import deployment
from lightning_sdk.production.episodes import episode_id
from lightning_sdk.production.gpu_turn import gpu_turn
from lightning_sdk.tracing.records import GATEWAY

from .test_serve_learn import ROOT, every_one_better, project, reward_all, traffic, wait_for


def test_the_door_waits_for_the_calls_inside_and_holds_new_ones_until_it_opens():
    door = Door()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(door.enter())  # a call at the backend
        with pytest.raises(TimeoutError, match="1 call"):
            with door.closed(timeout=0.2):
                pass
        # it gave up and opened again: a new call passes at once
        loop.run_until_complete(asyncio.wait_for(door.enter(), 1.0))
        door.leave()
        door.leave()
        entered = []

        async def late():
            await door.enter()
            entered.append(time.monotonic())

        with door.closed(timeout=1.0):  # nothing inside: the body runs at once
            task = loop.create_task(late())
            loop.run_until_complete(asyncio.sleep(0.3))
            assert not entered and door.waited == 1  # held while closed
            opened = time.monotonic()
        loop.run_until_complete(asyncio.wait_for(task, 1.0))
        assert entered and entered[0] >= opened and door.inside == 1
        door.leave()
        with door.closed(timeout=1.0):  # a thousand calls wait, each woken once the door opens
            many = [loop.create_task(door.enter()) for _ in range(1000)]
            loop.run_until_complete(asyncio.sleep(0.2))
            assert not any(t.done() for t in many) and door.waited == 1001
        loop.run_until_complete(asyncio.wait_for(asyncio.gather(*many), 5.0))
        assert door.inside == 1000
    finally:
        loop.close()


class Sleeper:
    """The real built-in server, told to sleep and wake as vLLM would be; records the door's state at each."""

    def __init__(self, server, door: Door, wake: threading.Event):
        self.server, self.door, self.wake = server, door, wake
        self.can_sleep = True
        self.asleep = threading.Event()
        self.seen: list[tuple[str, int]] = []  # (what, calls at the backend then)

    def sleep(self) -> None:
        self.seen.append(("sleep", self.door.inside))
        self.asleep.set()

    def wake_up(self) -> None:
        assert self.wake.wait(60), "the test did not let the server wake"
        self.seen.append(("wake", self.door.inside))

    def __getattr__(self, name):
        return getattr(self.server, name)


@pytest.fixture
def served(tmp_path):
    """A `lightning serve` that learns (real gateway, built-in server, store), its update's turn taken with a
    `Sleeper` in front of the real server, and four rewarded calls waiting for the update; yields (the deployment,
    the sleeper, the event that lets it wake)."""
    dep = deployment.start(project(tmp_path), tmp_path / "serve", host="127.0.0.1", port=0, api_key=None,
                           retention_s=3600, scorer=every_one_better)
    wake = threading.Event()
    sleeper = Sleeper(dep.server, dep.gateway.door, wake)
    dep.schedule.learner.turn = gpu_turn(dep.gateway, sleeper)
    try:
        calls = traffic(dep, 4)
        dep.gateway.capture.flush()
        reward_all(dep, calls)
        yield dep, sleeper, wake
    finally:
        wake.set()
        dep.close()


def test_an_update_puts_the_server_to_sleep_with_no_call_in_flight_and_holds_calls_until_it_wakes(served):
    dep, sleeper, wake = served
    update = threading.Thread(target=dep.schedule.run_once)
    update.start()
    assert sleeper.asleep.wait(120), "the update did not put the server to sleep"
    asleep = time.monotonic()
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key=dep.api_key, max_retries=0, timeout=120)
    trace, answered = uuid.uuid4().hex, []

    def call():
        answered.append(client.chat.completions.create(
            model="gpt-4o-mini", max_tokens=2, messages=[{"role": "user", "content": "What is 1 + 1?"}],
            extra_headers={"traceparent": f"00-{trace}-{'cd' * 8}-01"}))

    waited = dep.gateway.door.waited
    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: dep.gateway.door.waited == waited + 1, 60)  # the call reached the closed door
    assert not answered  # held at the gateway while the server sleeps
    woke = time.monotonic()
    wake.set()
    caller.join(60)
    update.join(120)
    assert answered and answered[0].choices  # answered once the server woke, not refused
    assert sleeper.seen == [("sleep", 0), ("wake", 0)]  # nothing at the backend when it slept or woke
    learner = dep.schedule.learner
    (u,) = learner.updates()
    assert learner.trainer().global_step == 1  # it left the GPU after the update; reloaded from its checkpoint
    m = json.loads(u["evidence"])["metrics"]
    assert m["calls_held"] == 1 and m["held_s"] >= woke - asleep and m["held_s"] >= m["drain_s"] + m["sleep_s"]
    dep.gateway.capture.flush()
    (held,) = [s for s in dep.store.spans(episode_id(trace)) if s.source == GATEWAY]
    assert held.attributes  # the held call is recorded like any other


def test_an_update_that_fails_wakes_the_server_and_the_held_calls_are_answered(served, monkeypatch):
    from lightning_sdk.train.trainer import GRPOTrainer

    def out_of_memory(self, *a, **kw):
        raise RuntimeError("CUDA out of memory (raised by the test)")

    monkeypatch.setattr(GRPOTrainer, "step", out_of_memory)
    dep, sleeper, wake = served
    wake.set()
    with pytest.raises(RuntimeError, match="out of memory"):
        dep.schedule.run_once()
    assert sleeper.seen == [("sleep", 0), ("wake", 0)]  # woken though the update failed
    assert traffic(dep, 1)  # the door is open: a call is answered
    assert dep.schedule.learner.updates() == [] and len(dep.schedule.learner.pending()) == 4  # kept, unread


def settled(visible: int, backend: str = "vllm", learn: bool = True, **tables):
    """A serve config placed on `visible` GPUs with the defaults the placement implies set (as deployment.start
    does), and its placement."""
    from lightning_sdk import config
    from lightning_sdk.placement import defaults_for, place

    tables = {"agent": {"module": "agent"}, "data": {"train": "t.jsonl", "eval": "t.jsonl"},
              **({"learn": {}} if learn else {}), **tables}
    tables["serve"] = {"backend": backend, **tables.get("serve", {})}
    cfg = config.parse(tables)
    placement = place(cfg, visible=visible, backend=backend)
    defaults_for(cfg, placement)
    return cfg, placement


@pytest.mark.parametrize("visible, backend, learn, tables, turn", [
    (1, "vllm", True, {}, True),                                                    # one GPU: shared in time
    (1, "vllm", True, {"serve": {"sleep_level": 0}}, False),                         # vLLM kept awake (set)
    (1, "vllm", True, {"train": {"device": "cpu"}}, False),                          # a CPU trainer: never
    (1, "vllm", False, {}, False),                                                   # no [learn]: no trainer
    (2, "vllm", True, {}, False),                                                    # 2 GPUs: apart, vLLM awake
    (2, "vllm", True, {"serve": {"sleep_level": 1}}, False),                          # apart, sleep_level kept: no need
    (4, "vllm", True, {"serve": {"replicas": 2}}, False),                             # 2 replicas + the trainer apart
    (4, "vllm", True, {"train": {"device": "cpu"}}, False),                          # every GPU serves, CPU trainer
    (2, "vllm", True, {"devices": {"serve": [0, 1], "train": [0, 1]}}, True),        # a ReplicaSet sharing its GPUs
    (2, "vllm", True, {"devices": {"serve": [0], "train": [0]}}, True),              # one GPU shared, by [devices]
    (2, "vllm", True, {"train": {"device": "cuda:1"}}, False),                        # the trainer pinned apart
    (0, "cpu", True, {}, False),                                                     # the built-in server
    (1, "cpu", True, {"serve": {"device": "cuda"}}, False),                           # the built-in server cannot sleep
])
def test_serve_takes_the_gpu_turn_only_where_serving_and_training_share_a_gpu_with_a_cuda_trainer(
        visible, backend, learn, tables, turn):
    from lightning_sdk.production.gpu_turn import takes_turn

    cfg, placement = settled(visible, backend, learn, **tables)
    assert takes_turn(cfg, placement, backend) is turn


def test_serve_on_2_or_more_gpus_is_placed_as_a_run_is_with_vllm_awake_and_most_of_its_gpus():
    for visible, serving, train in ((2, (0,), (1,)), (4, (0, 1), (2, 3)), (8, (0, 1, 2, 3), (4, 5, 6, 7))):
        cfg, placement = settled(visible)
        assert (placement.serving, placement.train) == (serving, train)
        assert (cfg.serve.sleep_level, cfg.serve.gpu_memory_utilization) == (0, 0.9)  # docs/gpu.md's 2+ GPU rows
    cfg, placement = settled(1)
    assert (cfg.serve.sleep_level, cfg.serve.gpu_memory_utilization) == (1, 0.5)
    cfg, placement = settled(4, train={"device": "cpu"})  # every GPU serves; the one-GPU defaults stay (docs/gpu.md)
    assert (placement.serving, placement.train) == ((0, 1, 2, 3), ())
    assert (cfg.serve.sleep_level, cfg.serve.gpu_memory_utilization) == (1, 0.5)


def test_serve_places_the_learner_s_trainer_on_the_placement_s_train_gpu_and_says_so(tmp_path, monkeypatch):
    # The built-in server on the CPU with two GPUs visible (torch's count, set: no GPU here): the placement gives the
    # trainer both; the learner takes the first (one process), the server is not asked to sleep.
    import torch

    from lightning_sdk.placement import trainer_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    dep = deployment.start(project(tmp_path), tmp_path / "serve", host="127.0.0.1", port=0, api_key=None,
                           retention_s=3600, scorer=every_one_better)
    try:
        assert (dep.placement.serving, dep.placement.train) == ((), (0, 1))
        assert dep.schedule.learner.gpus == (0, 1) and dep.schedule.learner.turn is None and not dep.turns
        assert trainer_device(dep.schedule.learner.cfg.train.device, dep.schedule.learner.gpus) == "cuda:0"
        assert dep.placement_line() == ("placement: 2 GPU(s) visible; 1 inference server on the CPU; the learner's "
                                        "trainer on GPU 0, at once (serving goes on during each update); GPU 1 "
                                        "idle: the learner trains in one process")
    finally:
        dep.close()


def test_serve_refuses_gpus_that_are_not_there_in_one_line_before_anything_is_written(tmp_path):
    import os
    import re
    import subprocess
    import sys

    project(tmp_path)
    out = subprocess.run([sys.executable, "-c", "from lightning_sdk.cli import main; main()", "serve", "--set",
                          'serve.device="cuda"', "--set", "devices.serve=[63]", "--dir", str(tmp_path / "serve")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    said = (out.stdout + out.stderr).strip()
    assert out.returncode == 2 and len(said.splitlines()) == 1, said
    assert re.fullmatch(r"[Ee]rror: devices\.serve = \[63\]: (no CUDA GPU is visible; leave \[devices\] out on the CPU|"
                        r"only \d+ GPU\(s\) are visible \(0-\d+\))", said), said
    assert not (tmp_path / "serve").exists()
