"""End to end: `lightning run` on the tiny model, as a subprocess, then `--resume`, then `lightning traces`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdk.store import Store

ROOT = Path(__file__).resolve().parents[1]


def lightning(*args, cwd, timeout=400):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "lightning_sdk.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("project")
    shutil.copy(ROOT / "cookbook/arith/agent.py", d / "agent.py")
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9]) + "\n")  # 12 tasks
    (d / "eval.jsonl").write_text("\n".join(rows[::20]) + "\n")  # 5 tasks
    (d / "lightning.toml").write_text("""
[run]
name = "e2e"
dir = "run"
iterations = 2
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
tasks_per_iteration = 4
group_size = 4
[model]
name = "builtin:tiny-arith"
dtype = "float32"
[rollout]
concurrency = 8
[train]
lr = 2e-3
lora_r = 8
micro_batch_size = 8
""")
    return d


def test_run_trains_writes_everything_and_resumes(project):
    first = lightning("run", cwd=project)
    assert first.returncode == 0, first.stdout + first.stderr
    run = project / "run"
    assert "reward per iteration" in first.stdout and "untrained" in first.stdout and "trained" in first.stdout

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(r["transitions"] == 16 and r["rollouts"] == 16 for r in rows)
    assert rows[0]["policy"] == "builtin:tiny-arith" and rows[1]["policy"] == "e2e-iter1"
    assert (run / "reward_curve.png").stat().st_size > 0 and any((run / "tensorboard").iterdir())

    store = Store(run / "store.sqlite")
    train = store.rollouts(phase="train")
    assert len(train) == 32 and all(r.status == "succeeded" for r in train)
    assert {r.model for r in train if r.iteration == 1} == {"e2e-iter1"}  # iteration 2 sampled the new adapter
    assert len(store.rollouts(phase="eval")) == 10
    assert store.count("spans") >= 42  # one LLM call per rollout

    adapter = run / "checkpoints/iter-00002/trainer/adapter"
    assert (adapter / "adapter_config.json").exists()

    # The served model changed: the trained adapter gives different log-probs than the base for the same prompt.
    from peft import PeftModel

    from lightning_sdk import models
    import torch

    path = models.resolve("builtin:tiny-arith")
    tok = models.load_tokenizer(path)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is 4 + 4?"}],
                                                add_generation_prompt=True)["input_ids"]])
    base = models.load_causal_lm(path, dtype="float32")
    with torch.no_grad():
        before = base(ids).logits[0, -1].log_softmax(-1)
        tuned = PeftModel.from_pretrained(base, str(adapter))
        after = tuned(ids).logits[0, -1].log_softmax(-1)
    assert (after - before).abs().max() > 1e-3

    # Resume continues after the last checkpoint without redoing iterations.
    second = lightning("run", "--resume", "--iterations", "3", cwd=project)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed" in second.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[2]["policy"] == "e2e-iter2"
    assert len(Store(run / "store.sqlite").rollouts(phase="train")) == 48

    traces = lightning("traces", "--run-dir", str(run), "-n", "5", cwd=project)
    assert traces.returncode == 0 and "succeeded" in traces.stdout
    assert f"{Store(run / 'store.sqlite').count('rollouts')} rollouts" in traces.stdout

    # Running again without --resume refuses to touch the existing run.
    again = lightning("run", cwd=project)
    assert again.returncode == 2 and "already holds a run" in again.stdout + again.stderr


def test_bad_config_exits_2_naming_the_key(project, tmp_path):
    bad = tmp_path / "lightning.toml"
    bad.write_text((project / "lightning.toml").read_text().replace("lr = 2e-3", "learning_rate = 2e-3"))
    out = lightning("run", "-c", str(bad), cwd=project)
    assert out.returncode == 2 and "train.learning_rate: unknown key" in out.stdout + out.stderr


def test_agent_that_bypasses_the_server_is_a_loud_capture_error(project, tmp_path):
    """'0 transitions' never becomes an empty update: the run stops and names the rollout."""
    (tmp_path / "agent.py").write_text(
        "import lightning_sdk as ls\n\n"
        "@ls.rollout\n"
        "def solve(task, llm):\n"
        "    return task['answer']  # never calls the LLM\n\n"
        "@ls.reward\n"
        "def score(task, output):\n"
        "    return 1.0\n")
    shutil.copy(project / "train.jsonl", tmp_path / "train.jsonl")
    text = (project / "lightning.toml").read_text().replace('eval = "eval.jsonl"\n', "")
    (tmp_path / "lightning.toml").write_text(text)
    out = lightning("run", cwd=tmp_path)
    assert out.returncode == 1
    assert "no LLM call was captured" in out.stdout and "rollout it0000-" in out.stdout
