"""A first run, as a new user makes it: a minimal lightning.toml on the default model, started from Python inside a
running event loop (a notebook), that learns, numbers its iterations one way everywhere and explains itself."""

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_sdk as ls
from lightning_sdk import config
from lightning_sdk.store import Store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """`ls.run` on a lightning.toml with only [agent] and [data], called inside asyncio.run (as from Jupyter)."""
    d = tmp_path_factory.mktemp("first")
    (d / "agent.py").write_text((ROOT / "cookbook/arith/agent.py").read_text())
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows) + "\n")
    (d / "eval.jsonl").write_text("\n".join(rows[::2]) + "\n")  # 50 of the 100 sums: half the eval time
    (d / "lightning.toml").write_text('[agent]\nmodule = "agent.py"\n\n[data]\ntrain = "train.jsonl"\n'
                                      'eval = "eval.jsonl"\n')

    async def notebook_cell():
        asyncio.get_running_loop()  # what a Jupyter cell runs in; asyncio.Runner refuses to start inside it
        return ls.run(d / "lightning.toml", iterations=5, run_dir=d / "run")

    return d, asyncio.run(notebook_cell())


def test_minimal_config_learns_from_inside_an_event_loop(first_run):
    _, result = first_run
    rewards = [row["rollout/reward_mean"] for row in result.history]
    print(f"minimal config: eval {result.eval_untrained:.3f} -> {result.eval_trained:.3f}, train reward {rewards}")
    assert len(rewards) == 5 and result.state.completed == 5
    assert result.eval_trained > result.eval_untrained + 0.2  # measured 0.12 -> 0.65 (6 iterations, 100 tasks)
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.2


def test_one_iteration_numbering_everywhere(first_run):
    d, result = first_run
    run = d / "run"
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("phase") != "eval"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5] == [r["iteration"] for r in result.history]
    # iteration n samples the adapter iteration n-1 trained, and checkpoints/iter-0000n holds run-iter<n>
    assert [r["policy"] for r in rows] == ["builtin:tiny-arith", "run-iter1", "run-iter2", "run-iter3", "run-iter4"]
    assert result.state.adapter_name == "run-iter5"
    assert result.adapter == run / "checkpoints/iter-00005/trainer/adapter"
    assert (result.adapter / "adapter_config.json").exists()
    store = Store(run / "store.sqlite")
    train = store.rollouts(phase="train")
    assert {r.iteration for r in train} == {1, 2, 3, 4, 5}
    assert {r.model for r in train if r.iteration == 3} == {"run-iter2"}
    assert all(r.rollout_id.startswith(f"it{r.iteration:04d}-") for r in train)
    assert {r.iteration for r in store.rollouts(phase="eval")} == {0, 5}  # before iteration 1, after iteration 5


def test_traces_show_the_whole_conversation(first_run):
    d, _ = first_run
    store = Store(d / "run/store.sqlite")
    rollout = store.rollouts(phase="train", limit=1)[0]
    task = store.task(rollout.task_id)
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "traces", "--run-dir", str(d / "run"),
                          "--rollout", rollout.rollout_id], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    completion = json.loads(store.spans(rollout.rollout_id)[0].attributes["gen_ai.output.messages"])
    assert f"user: {task['question']}" in out.stdout  # the prompt's user turn, not only the completion
    assert f"→ reply: {completion[0]['parts'][0]['content']}" in out.stdout


def test_output_that_is_not_a_terminal_cuts_no_value(first_run):
    d, _ = first_run
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # a log file: no terminal, no width
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "traces", "--run-dir", str(d / "run"), "-n", "3"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and "succeeded" in out.stdout and "eval-trained-" in out.stdout


def test_model_build_says_what_why_and_how_long(tmp_path, monkeypatch, caplog):
    from lightning_sdk import models

    monkeypatch.setenv("LIGHTNING_SDK_CACHE", str(tmp_path / "cache"))
    teacher = tmp_path / "teacher.py"
    teacher.write_text(
        "class T:\n    key = 'status-line'\n"
        "    def samples(self, rng, n):\n"
        "        return [('<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n', 'hello') for _ in range(n)]\n"
        "teacher = T()\nsteps = 20\nbatch = 4\n")  # 10 steps: OneCycleLR divides by zero
    with caplog.at_level(logging.INFO, logger="lightning_sdk"):
        path = models.resolve(f"tiny:{teacher}")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_sdk")]
    assert lines[0].startswith(f"building the model tiny:{teacher} (first use only, then cached in {path})")
    assert "no model hub is reachable offline" in lines[0] and "how long is left" in lines[0]
    assert any(line.startswith("  pretraining step 10/20,") and "s left" in line for line in lines)
    assert lines[-1].startswith(f"built tiny:{teacher} in ")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_sdk"):
        assert models.resolve(f"tiny:{teacher}") == path
    assert not caplog.records  # cached: nothing to say


def test_overrides_are_validated_like_the_file(tmp_path):
    (tmp_path / "lightning.toml").write_text('[agent]\nmodule = "agent.py"\n[data]\ntrain = "train.jsonl"\n')
    cfg = config.load(tmp_path / "lightning.toml")
    # per-model defaults: the tiny model's, unless the file or an override sets the key
    assert (cfg.train.lr, cfg.train.lora_r, cfg.train.epochs) == (2e-3, 8, 2) and "lm_head" in cfg.train.target_modules
    real = config.override(cfg, {"model.name": "Qwen/Qwen2.5-0.5B-Instruct", "train.lora_r": 4})
    assert (real.train.lr, real.train.lora_r, real.train.target_modules) == (1e-4, 4, "all-linear")
    with pytest.raises(config.ConfigError, match=r"^train\.lrr: unknown key; did you mean train\.lr\?$"):
        ls.run(tmp_path / "lightning.toml", **{"train.lrr": 1.0})
    with pytest.raises(config.ConfigError, match=r"^run\.iterations: Input should be greater than or equal to 1"):
        ls.run(tmp_path / "lightning.toml", iterations=0, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # bad input writes nothing
