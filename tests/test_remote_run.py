"""`lightning run` with run.runtime = "remote" and two `lightning worker` processes training the default arith task
for two iterations: the trainer never imports the agent, the workers end when the run does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lightning_sdk.store import Store

HERE = Path(__file__).parent
ROOT = HERE.parent


def test_two_workers_train_the_default_task_through_the_remote_runtime(tmp_path):
    d = tmp_path
    # The agent refuses to be imported anywhere but in a worker: the trainer must never import it.
    (d / "agent.py").write_text('import os\nassert os.environ.get("AGENT_SIDE") == "1", "imported by the trainer"\n'
                                + (ROOT / "cookbook/arith/agent.py").read_text())
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9]) + "\n")
    (d / "eval.jsonl").write_text("\n".join(rows[::25]) + "\n")
    (d / "lightning.toml").write_text("""
[run]
name = "remote"
dir = "run"
iterations = 2
runtime = "remote"
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
tasks_per_iteration = 4
group_size = 4
[model]
name = "builtin:tiny-arith"
[remote]
worker_timeout = 120
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    trainer = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run"], cwd=d, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        end = time.monotonic() + 180
        while not (d / "run/server.json").exists():
            assert trainer.poll() is None and time.monotonic() < end, trainer.stdout.read()
            time.sleep(0.1)
        url = json.loads((d / "run/server.json").read_text())["url"]
        side = {**env, "AGENT_SIDE": "1"}
        side.pop("LIGHTNING_TOKEN", None)
        workers = [  # one finds everything in the run directory and ./lightning.toml; one is told
            subprocess.Popen([sys.executable, str(HERE / "remote_worker_probe.py"), "worker", "--run-dir", "run",
                              "--concurrency", "4"], cwd=d, env=side, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True),
            subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "worker", "agent.py", "--server", url,
                              "--token-file", str(d / "run/worker.token"), "--concurrency", "4"], cwd=d, env=side,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
        out, _ = trainer.communicate(timeout=300)
        said = [w.communicate(timeout=60)[0] for w in workers]
    finally:
        for p in (trainer, *workers):
            p.kill()
    assert trainer.returncode == 0, out
    assert f"lightning worker --server {url} --token-file" in out and "reward per iteration" in out
    for w, text in zip(workers, said):
        assert w.returncode == 0 and "run 'remote' is over: worker" in text, text
    assert "IMPORTED []" in said[0]
    assert not (d / "run/worker.token").exists()  # the key died with the server

    metrics = [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r.get("phase") != "eval"]
    assert [(r["iteration"], r["rollouts"], r["transitions"], r["failed"]) for r in train] == [(1, 16, 16, 0),
                                                                                                (2, 16, 16, 0)]
    store = Store(d / "run/store.sqlite")
    rollouts = store.rollouts()
    assert len(rollouts) == 32 + 2 * 4 and {r.status for r in rollouts} == {"succeeded"}
    assert store.call_counts([r.rollout_id for r in rollouts]) == {r.rollout_id: 1 for r in rollouts}
    assert {r.model for r in rollouts if r.phase == "train" and r.iteration == 2} == {"remote-iter1"}
    shutil.rmtree(d / "run/checkpoints")  # the adapters: the largest files of the test
