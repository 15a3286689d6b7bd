"""The Ray runtime on a real local Ray instance (2 CPUs, 2 rollout-worker actors)."""

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

ray = pytest.importorskip("ray")

from lightning_sdk import config  # noqa: E402
from lightning_sdk.runtime import Runtime  # noqa: E402
from lightning_sdk.store import Store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = [json.loads(r) for r in (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    # Worker processes inherit the environment Ray starts with: the victim agent reads these.
    os.environ["LS_TEST_CALLS"] = str(d / "calls.txt")
    os.environ["LS_TEST_MARKER"] = str(d / "marker.txt")
    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    yield d
    ray.shutdown()


def make_cfg(tmp_path: Path, *, module: str, tasks: list[dict], iterations: int, group: int,
             serve: dict | None = None, servers: int = 1) -> config.Config:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return config.parse({
        "serve": serve or {},
        "run": {"name": "ray", "dir": "run", "iterations": iterations, "runtime": "ray"},
        "agent": {"module": module},
        "data": {"train": "train.jsonl", "tasks_per_iteration": len(tasks), "group_size": group},
        "model": {"name": "builtin:tiny-arith", "dtype": "float32"},
        "rollout": {"concurrency": 8, "timeout": 120},
        "train": {"lr": 2e-3, "lora_r": 8, "micro_batch_size": 16},
        "ray": {"num_workers": 2, "cpus_per_worker": 0.5, "servers": servers, "cpus_per_server": 1.0 / servers},
    }, base=tmp_path)




# vLLM's CPU build as one server actor (2 cores: one replica beside the two rollout workers), no sleep mode off CUDA.
VLLM = {"backend": "vllm", "sleep_level": 0, "startup_timeout": 900, "max_model_len": 512}


@pytest.mark.parametrize("serve", [pytest.param(None, id="cpu"), pytest.param(VLLM, marks=pytest.mark.vllm, id="vllm")])
def test_demo_runs_two_iterations_on_ray(ray_local, tmp_path, serve):
    """The default task, with the agent as one writes it for OpenAI: its client from the environment, its own
    model name, no `llm` argument. On the CPU two built-in server actors serve it behind the gateway, each adapter
    loaded into both; vLLM's CPU build is one (2 cores)."""
    servers = 1 if serve else 2
    cfg = make_cfg(tmp_path, module=str(Path(__file__).with_name("unchanged_agent.py")), tasks=ROWS[:4],
                   iterations=2, group=4, serve=serve, servers=servers)
    out = io.StringIO()
    state = Runtime(cfg, console=Console(file=out, width=300)).run()
    if servers == 2:  # both took calls, of each iteration's adapter (the records' model below)
        served = re.search(r"2 inference servers served (\d+) / (\d+) calls", out.getvalue())
        assert served and min(map(int, served.groups())) > 0, out.getvalue()[-2000:]
    assert state.completed == 2 and len(state.history) == 2
    with Store(cfg.run.dir / "store.sqlite") as store:
        rollouts = store.rollouts(phase="train")
        assert len(rollouts) == 2 * 16 and {r.status for r in rollouts} == {"succeeded"}
        assert {r.attempt for r in rollouts} == {1}
        # one LLM call per rollout, each with the server's token ids: the spans came back from the workers
        counts = store.call_counts([r.rollout_id for r in rollouts])
        assert all(counts.get(r.rollout_id) == 1 for r in rollouts)
        assert all(store.spans(r.rollout_id)[0].attributes.get("lightning.llm.completion_token_ids")
                   for r in rollouts)
        assert {r.model for r in rollouts if r.iteration == 2} == {"ray-iter1"}  # hot-loaded into the server actor
        assert {s.attributes["gen_ai.request.model"] for r in rollouts for s in store.spans(r.rollout_id)} == {
            "gpt-4o-mini"}
    rows = [json.loads(x) for x in (cfg.run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["rollout/failed"] == 0 and r["rollout/rollouts"] == 16 and r["rollout/transitions"] == 16 for r in rows)


def test_killed_worker_rollouts_are_retried_and_nothing_is_lost(ray_local, tmp_path):
    tasks = [dict(t) for t in ROWS[:4]]
    tasks[1]["victim"] = True
    cfg = make_cfg(tmp_path, module=str(ROOT / "tests/ray_victim_agent.py"), tasks=tasks, iterations=2, group=4)
    marker = Path(os.environ["LS_TEST_MARKER"])
    killed: dict = {}

    def killer():  # kill the worker as soon as the victim rollout says its span is in the store
        deadline = time.monotonic() + 300
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the marker is written in two steps
        name, rollout_id = marker.read_text().split("\n")
        killed.update(name=name, rollout_id=rollout_id)
        ray.kill(ray.get_actor(name))

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    state = Runtime(cfg).run()
    t.join(timeout=10)
    assert killed and state.completed == 2

    with Store(cfg.run.dir / "store.sqlite") as store:
        rollouts = store.rollouts(phase="train")
        by_id = {r.rollout_id: r for r in rollouts}
        victim = by_id[killed["rollout_id"]]
        assert victim.status == "abandoned" and victim.attempt == 1 and "worker died" in victim.error
        assert store.call_counts([victim.rollout_id]) == {victim.rollout_id: 1}  # its span was kept
        abandoned = [r for r in rollouts if r.status == "abandoned"]
        for r in abandoned:  # each was re-run once, on another worker, and that attempt counted
            again = by_id[f"{r.rollout_id}-r2"]
            assert again.attempt == 2 and again.status == "succeeded" and again.group_id == r.group_id
        ok = [r for r in rollouts if r.status == "succeeded"]
        assert len(ok) == 2 * 16 and len({r.rollout_id for r in ok}) == len(ok)
        for it in (1, 2):  # every GRPO group is whole, with no duplicates
            groups = [r.group_id for r in ok if r.iteration == it]
            assert sorted(groups.count(g) for g in set(groups)) == [4] * 4
        assert {r.status for r in rollouts} <= {"succeeded", "abandoned"}
        # every LLM call an agent made (logged after its span reached the store) is a span in the store
        calls = Path(os.environ["LS_TEST_CALLS"]).read_text().split()
        spans = store.call_counts(list(by_id))
        assert all(spans.get(c, 0) >= calls.count(c) for c in set(calls))
        # The gateway records a call when it answers it: a worker killed before its agent logged a call it got the
        # reply of leaves that call's record, on a rollout that was abandoned; every other count is exact.
        extra = {r: n - calls.count(r) for r, n in spans.items() if n != calls.count(r)}
        assert all(by_id[r].status == "abandoned" for r in extra), extra
    rows = [json.loads(x) for x in (cfg.run.dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/failed"] == 0 and r["rollout/rollouts"] == 16 for r in rows)


def test_ray_config_errors_name_the_key(tmp_path):
    base = {"agent": {"module": "a.py"}, "data": {"train": "t.jsonl"}}
    with pytest.raises(config.ConfigError, match=r"run\.runtime"):
        config.parse({**base, "run": {"runtime": "spark"}})
    with pytest.raises(config.ConfigError, match=r"ray\.num_workers"):
        config.parse({**base, "ray": {"num_workers": 0}})
    with pytest.raises(config.ConfigError, match=r"ray\.object_store_memory"):
        config.parse({**base, "ray": {"object_store_memory": 1000}})
    with pytest.raises(config.ConfigError, match=r"ray\.adress: unknown key"):
        config.parse({**base, "ray": {"adress": "auto"}})
    assert config.parse(base).run.runtime == "embedded"


def test_importing_the_sdk_does_not_import_ray():
    code = ("import sys, lightning_sdk, lightning_sdk.runtime, lightning_sdk.gateway.proxy; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_rollout_abandoned_before_it_began_is_stored_when_run_again(tmp_path):
    # A dead worker's queued job that never started is resubmitted under the same id: its rows must be written.
    from lightning_sdk.rollouts import ray as ray_rollouts

    writer = ray_rollouts._StoreWriter(str(tmp_path / "store.sqlite"))
    row = dict(task_id="t", group_id="g", iteration=1, phase="train", attempt=1, model="m")
    assert writer.abandon("queued", "rollout worker died") is False
    writer.start_rollout("queued", row)
    writer.finish_rollout("queued", dict(status="succeeded", output="4", reward=1.0))
    writer.start_rollout("begun", row)
    assert writer.abandon("begun", "rollout worker died") is True
    writer.finish_rollout("begun", dict(status="succeeded", output="4", reward=1.0))  # the dead worker's late result
    store = Store(tmp_path / "store.sqlite")
    assert store.rollout("queued").status == "succeeded" and store.rollout("queued").reward == 1.0
    assert store.rollout("begun").status == "abandoned"
