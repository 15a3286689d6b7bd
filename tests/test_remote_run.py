"""`lightning run` with run.runtime = "remote" and two `lightning worker` processes training the default arith task
for two iterations: the trainer never imports the agent, the workers end when the run does. One worker runs in a
light environment of its own, built here as the README says (`pip install -e .`, no `train` extra): no torch,
transformers or peft in it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_sdk.store import Store

from .remote_harness import start_remote_run

HERE = Path(__file__).parent
ROOT = HERE.parent


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with this project installed without extras: the agent side only."""
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin/pip"), "install", "--disable-pip-version-check", "-q", "-e", str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return venv


def test_the_light_environment_has_the_agent_side_only(light_venv, tmp_path):
    python = str(light_venv / "bin/python")
    for heavy in ("torch", "transformers", "peft", "fastapi", "uvicorn"):
        r = subprocess.run([python, "-c", f"import {heavy}"], capture_output=True, text=True)
        assert r.returncode == 1 and f"No module named '{heavy}'" in r.stderr
    r = subprocess.run([python, "-c", "import lightning_sdk as ls, lightning_sdk.rollouts.remote.worker; print(ls.rollout)"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(light_venv / "bin/lightning"), "run", "-c", str(ROOT / "lightning.toml")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "lightning run needs the `train` extra" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "runs").exists()


def test_the_run_prints_where_the_token_is_never_the_token(tmp_path):
    """The trainer's output lands in CI logs and nohup files: it names worker.token, and the token is not in it."""
    (tmp_path / "train.jsonl").write_text('{"question": "What is 1 + 2?", "answer": "3"}\n')
    (tmp_path / "lightning.toml").write_text('[run]\ndir = "run"\nruntime = "remote"\n[data]\ntrain = "train.jsonl"\n'
                                             'tasks_per_iteration = 1\ngroup_size = 2\n[remote]\nworker_timeout = 2\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    trainer = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run"], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    token_file, token = tmp_path / "run/worker.token", ""
    try:
        end = time.monotonic() + 180
        while not token:  # read while the run lives: the file goes with it
            assert trainer.poll() is None and time.monotonic() < end, trainer.stdout.read()
            token = token_file.read_text().strip() if token_file.exists() else ""
            time.sleep(0.05)
        out, _ = trainer.communicate(timeout=180)  # no worker comes: the run stops after remote.worker_timeout
    finally:
        trainer.kill()
    assert trainer.returncode == 1 and "no worker contacted the server" in out, out
    assert len(token) >= 40 and token not in out
    assert f"The token is in {token_file} (readable by this user only)" in out, out


def test_two_workers_train_the_default_task_through_the_remote_runtime(tmp_path, light_venv, receiver):
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
otlp_endpoint = "%s"
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
""" % receiver.url)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    trainer, url = start_remote_run(d, env)
    workers = []
    try:
        side = {**env, "AGENT_SIDE": "1"}
        side.pop("LIGHTNING_TOKEN", None)
        light = {k: v for k, v in side.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        workers = [  # one finds everything in the run directory and ./lightning.toml; one is told, in its own venv
            subprocess.Popen([sys.executable, str(HERE / "remote_worker_probe.py"), "worker", "--run-dir", "run",
                              "--concurrency", "4"], cwd=d, env=side, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True),
            subprocess.Popen([str(light_venv / "bin/lightning"), "worker", "agent.py", "--server", url,
                              "--token-file", str(d / "run/worker.token"), "--concurrency", "4"], cwd=d, env=light,
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
    light_did = re.search(r"exits \((\d+) succeeded", said[1])
    assert light_did and int(light_did.group(1)) > 0, said[1]  # the light environment's worker trained too
    assert not (d / "run/worker.token").exists()  # the key died with the server

    metrics = [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r.get("phase") != "eval"]
    assert [(r["iteration"], r["rollout/rollouts"], r["rollout/transitions"], r["rollout/failed"]) for r in train] == [(1, 16, 16, 0),
                                                                                                (2, 16, 16, 0)]
    store = Store(d / "run/store.sqlite")
    rollouts = store.rollouts()
    assert len(rollouts) == 32 + 2 * 4 and {r.status for r in rollouts} == {"succeeded"}
    assert store.call_counts([r.rollout_id for r in rollouts]) == {r.rollout_id: 1 for r in rollouts}
    assert {r.model for r in rollouts if r.phase == "train" and r.iteration == 2} == {"remote-iter1"}
    # The run's collector (run.otlp_endpoint) holds one tree per rollout though the workers ran them: the root (the
    # rollout's own span, exported by the server from the result it accepted, with task, reward and status), every
    # other span of the trace beneath it, and exactly the spans the store keeps besides.
    got = receiver.by_rollout()
    assert set(got) == {r.rollout_id for r in rollouts}
    for r in rollouts:
        spans = got[r.rollout_id]
        (root,) = [s for s in spans if not s["parent_id"]]
        a = root["attributes"]
        assert root["name"] == "invoke_agent solve" and a["lightning.task.id"] == r.task_id
        assert a["lightning.rollout.status"] == "succeeded" and a["lightning.reward.value"] == r.reward
        assert {s["trace_id"] for s in spans} == {root["trace_id"]}
        ids = {s["span_id"] for s in spans}
        assert all(s["parent_id"] in ids for s in spans if s["parent_id"])
        assert ids == {s.span_id for s in store.spans(r.rollout_id)} | {root["span_id"]}
    shutil.rmtree(d / "run/checkpoints")  # the adapters: the largest files of the test
