"""[policies] on the Ray and remote runtimes: two policies (writer, rewriter) for two iterations, on a real local Ray
instance and with a real `lightning worker`. The gateway's record shows each call served by its component's adapter
(the judge's by the base), and both adapters were trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_sdk import tracing
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import COMPONENT, POLICY

from .remote_harness import start_remote_run

HERE = Path(__file__).parent
ROOT = HERE.parent
BASE = "builtin:tiny-arith"


def write_run(d: Path, runtime: str, extra: str = "") -> None:
    """A two-policy run of 2 iterations x 3 tasks x 4 rollouts, each rollout a writer, rewriter and judge call, then
    an eval of 2 tasks under the trained adapters."""
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9][:3]) + "\n")
    (d / "eval.jsonl").write_text("\n".join(rows[1::9][:2]) + "\n")
    (d / "lightning.toml").write_text(f'''
[run]
name = "duo"
dir = "run"
iterations = 2
runtime = "{runtime}"
[agent]
module = "{HERE / 'policies_agent.py'}"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
tasks_per_iteration = 3
group_size = 4
[model]
name = "{BASE}"
dtype = "float32"
[rollout]
concurrency = 8
timeout = 120
[train]
micro_batch_size = 16
[policies.writer]
components = ["writer"]
[policies.rewriter]
components = ["rewriter"]
lora_r = 4
{extra}''')


def served_by(run: Path, phase: str) -> dict[tuple[int, str], set[str]]:
    """(iteration, component) -> the adapters the gateway recorded serving those calls in `phase`."""
    served: dict[tuple[int, str], set[str]] = {}
    with Store(run / "store.sqlite") as store:
        for r in store.rollouts(phase=phase):
            for s in store.spans(r.rollout_id):
                if tracing.is_llm_call(s) and s.source == "gateway":
                    served.setdefault((r.iteration, s.attributes[COMPONENT]), set()).add(s.attributes[POLICY])
    return served


def assert_two_policies_trained(run: Path) -> None:
    assert served_by(run, "train") == {(1, "writer"): {BASE}, (1, "rewriter"): {BASE}, (1, "judge"): {BASE},
                              (2, "writer"): {"duo-writer-iter1"}, (2, "rewriter"): {"duo-rewriter-iter1"},
                              (2, "judge"): {BASE}}
    # the held-out eval: before training all by the base, after it by the adapters of the last update
    assert served_by(run, "eval") == {(0, c): {BASE} for c in ("writer", "rewriter", "judge")} | {
        (2, "writer"): {"duo-writer-iter2"}, (2, "rewriter"): {"duo-rewriter-iter2"}, (2, "judge"): {BASE}}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval"] for r in rows if r.get("phase") == "eval"] == ["untrained", "trained"]
    rows = [r for r in rows if r.get("phase") != "eval"]
    assert [r["iteration"] for r in rows] == [1, 2]
    for r in rows:  # 12 rollouts, each one call per role: each policy trained on its own 12, the judge's counted
        assert r["rollout/failed"] == 0 and r["rollout/transitions/writer"] == r["rollout/transitions/rewriter"] == 12
        assert r["rollout/base_calls"] == 12
    for name, rank in (("writer", 8), ("rewriter", 4)):
        one, two = (load_file(run / f"checkpoints/iter-0000{i}/trainer/adapters/{name}/adapter_model.safetensors")
                    for i in (1, 2))
        assert one and all("lora_" in k for k in one)  # the adapter only: the base is neither saved nor trained
        assert any(v.abs().max() > 0 for k, v in one.items() if "lora_B" in k)  # LoRA B starts at zero
        assert any(not torch.equal(one[k], two[k]) for k in one)  # the second update moved it again
        assert {v.shape[0] for k, v in one.items() if "lora_A" in k} == {rank}


def test_two_policies_on_ray(tmp_path):
    ray = pytest.importorskip("ray")
    from lightning_sdk import config
    from lightning_sdk.runtime import Runtime

    write_run(tmp_path, "ray", '[ray]\nnum_workers = 2\ncpus_per_worker = 0.5\nservers = 1\ncpus_per_server = 1.0\n'
                               'num_cpus = 2\nobject_store_memory = 83886080\n')
    cfg = config.load(tmp_path / "lightning.toml")
    try:
        state = Runtime(cfg).run()
    finally:
        ray.shutdown()
    assert state.completed == 2 and state.adapter_names == {"writer": "duo-writer-iter2",
                                                           "rewriter": "duo-rewriter-iter2"}
    assert_two_policies_trained(cfg.run.dir)


def test_two_policies_with_a_remote_worker(tmp_path):
    write_run(tmp_path, "remote", "[remote]\nworker_timeout = 120\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("LIGHTNING_TOKEN", None)
    trainer, _ = start_remote_run(tmp_path, env)
    worker = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "worker", "--run-dir", "run",
                               "--concurrency", "8"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = trainer.communicate(timeout=300)
        said, _ = worker.communicate(timeout=60)
    finally:
        for p in (trainer, worker):
            p.kill()
    assert trainer.returncode == 0, out
    assert worker.returncode == 0 and "run 'duo' is over: worker" in said, said
    assert_two_policies_trained(tmp_path / "run")
