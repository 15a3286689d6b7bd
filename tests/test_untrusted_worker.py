"""Workers are untrusted: a real `lightning run` (remote runtime) with a good `lightning worker` beside one that
sends garbage (tests/remote_evil_worker.py). Each bad rollout fails with one line naming the field (or trains on
the gateway's record only), the run goes on and exits 0, and every tensor of every adapter it saved is finite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.numpy import load_file

from lightning_sdk.store import Store

from .remote_harness import start_remote_run

HERE = Path(__file__).parent
ROOT = HERE.parent


def test_a_worker_sending_garbage_fails_its_rollouts_only(tmp_path):
    d = tmp_path
    (d / "agent.py").write_text((ROOT / "cookbook/arith/agent.py").read_text())
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9]) + "\n")
    (d / "lightning.toml").write_text("""
[run]
name = "untrusted"
dir = "run"
iterations = 2
runtime = "remote"
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
tasks_per_iteration = 4
group_size = 4
[model]
name = "builtin:tiny-arith"
[remote]
worker_timeout = 120
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    trainer, url = start_remote_run(d, env)
    workers = []
    try:
        token = (d / "run/worker.token").read_text().strip()
        evil = subprocess.run([sys.executable, str(HERE / "remote_evil_worker.py"), url, token, "8"], cwd=d,
                              capture_output=True, text=True, timeout=180, env={"PATH": "/usr/bin:/bin"})
        workers.append(subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "worker", "agent.py", "--run-dir",
                                         "run", "--concurrency", "4"], cwd=d, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True))
        out, _ = trainer.communicate(timeout=300)
        workers[0].communicate(timeout=60)
    finally:
        for p in (trainer, *workers):
            p.kill()
    assert evil.returncode == 0, evil.stderr
    did = {r["did"]: r for r in map(json.loads, evil.stdout.splitlines())}
    assert len(did) == 8, evil.stdout
    assert trainer.returncode == 0, out  # the run went on
    assert did["foreign_result"]["answer"][0] == 403
    store = Store(d / "run/store.sqlite", read_only=True)
    row = {what: store.rollout(r["rollout_id"]) for what, r in did.items()}
    for what, field in (("nan_reward", "reward"), ("string_reward", "reward"), ("huge_reward", "reward"),
                        ("unbounded_reward", "reward"),
                        ("nan_reward_span", "lightning.reward.value")):
        assert row[what].status == "failed" and field in row[what].error and "\n" not in row[what].error, \
            (what, row[what].error)
    assert row["bogus_token_ids"].status == "succeeded"  # trained on the gateway's record of its call, not the ids
    assert row["prompt_too_long"].status == "succeeded"  # its only call failed at the server: nothing to train
    calls = [s for s in store.spans(did["prompt_too_long"]["rollout_id"]) if s.source == "gateway"]
    assert [c.status for c in calls] == ["ERROR"]
    metrics = [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in metrics if "rollout/reward_mean" in r] == [1, 2]
    adapters = list((d / "run/checkpoints").glob("*/trainer/adapter/*.safetensors"))
    assert adapters
    for path in adapters:
        for name, tensor in load_file(str(path)).items():
            assert (tensor == tensor).all() and abs(tensor).max() < float("inf"), (path, name)
