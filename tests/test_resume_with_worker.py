"""`--resume` of a remote run with its worker still running: the run is killed (SIGKILL, inference server and all)
after its first checkpoint, resumed, and the same `lightning worker` process, which waited meanwhile, goes on
working for it until the run ends; both exit 0. The resumed run serves where the killed one did, with the same
workers' key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _wait_for(what, predicate, procs, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"{what}: a process ended early (rc {p.returncode})"
        assert time.monotonic() < end, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.2)


def test_a_resumed_run_keeps_its_worker(tmp_path):
    d = tmp_path
    (d / "agent.py").write_text((ROOT / "cookbook/arith/agent.py").read_text())
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[:12]) + "\n")
    (d / "lightning.toml").write_text(
        '[run]\nname = "resumed"\ndir = "run"\niterations = 3\nruntime = "remote"\n[agent]\nmodule = "agent.py"\n'
        '[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 2\ngroup_size = 2\n[model]\nname = "builtin:tiny-arith"\n'
        '[remote]\nworker_timeout = 90\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    cli = [sys.executable, "-m", "lightning_sdk.cli"]
    first_log, worker_log = open(d / "first.log", "w"), open(d / "worker.log", "w")
    first = subprocess.Popen([*cli, "run"], cwd=d, env=env, stdout=first_log, stderr=subprocess.STDOUT,
                             start_new_session=True)  # its own group: the kill takes its inference server too
    worker = resumed = None
    try:
        _wait_for("the first run's server", (d / "run/server.json").exists, [first], 240)
        url = json.loads((d / "run/server.json").read_text())["url"]
        worker = subprocess.Popen([*cli, "worker", "agent.py", "--run-dir", "run", "--concurrency", "2"], cwd=d,
                                  env=env, stdout=worker_log, stderr=subprocess.STDOUT)
        _wait_for("the first checkpoint", (d / "run/checkpoints/iter-00001/state.json").exists, [first, worker], 300)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        time.sleep(2)  # the worker notices the server is gone
        resumed = subprocess.run([*cli, "run", "--resume"], cwd=d, env=env, capture_output=True, text=True,
                                 timeout=420)
        worker.wait(120)
    finally:
        for p in (first, worker):
            if p is not None and p.poll() is None:
                p.kill()
        first_log.close()
        worker_log.close()
    out, log = resumed.stdout + resumed.stderr, (d / "worker.log").read_text()
    assert resumed.returncode == 0, out + "\n--- worker:\n" + log
    assert f"Lightning server for run 'resumed' at {url}" in out, out  # where the killed run served
    assert worker.returncode == 0, log  # it waited, then worked for the resumed run until it ended
    assert "refused the token" not in log and "is over: worker" in log, log
    metrics = [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in metrics if "rollout/reward_mean" in r][-2:] == [2, 3]
