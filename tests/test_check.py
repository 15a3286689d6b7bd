"""`lightning check`, run as a user runs it (a subprocess, the real server and gateway on 127.0.0.1): a good agent
would train (exit 0); an agent that calls no LLM, a greedy one, one whose reward raises, one whose calls are all of
another component and one whose rewards never differ would train nothing (exit 1), each told why and what to
change; bad input is one line, exit 2. Nothing is ever written into run.dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

AGENT = '''
import threading
from openai import OpenAI
import lightning_sdk as ls

LOCK, SEEN = threading.Lock(), set()
MODE = "{mode}"

@ls.rollout
def solve(task, llm):
    if MODE == "no-llm":
        return task["answer"]  # answered from a rule: no call
    with LOCK:
        first = task["question"] not in SEEN
        SEEN.add(task["question"])
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    with ls.component("judge" if MODE == "judge" else "solver"):
        client.chat.completions.create(model=llm.model, max_tokens=4, temperature=0.0 if MODE == "greedy" else 1.0,
                                       messages=[{{"role": "user", "content": task["question"]}}])
    return "win" if first else "lose"

@ls.reward
def score(task, output):
    if MODE == "reward-raises":
        return 1 / 0
    if MODE == "flat":
        return 0.5
    return 1.0 if output == "win" else 0.0
'''


def project(tmp_path: Path, mode: str, **extra: str) -> Path:
    (tmp_path / "agent.py").write_text(AGENT.format(mode=mode))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"What is {a} + 1?", "answer": str(a + 1)})
                                                  + "\n" for a in range(4)))
    tables = {"run": 'dir = "run"', "agent": 'module = "agent.py"',
              "data": 'train = "train.jsonl"\ngroup_size = 3', "model": 'dtype = "float32"',
              "rollout": "timeout = 60.0", **extra}
    (tmp_path / "lightning.toml").write_text("".join(f"[{k}]\n{v}\n" for k, v in tables.items()))
    return tmp_path / "lightning.toml"


def check(config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "220"}
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "check", "-c", str(config), *args],
                         capture_output=True, text=True, env=env, timeout=300, cwd=config.parent)
    assert not (config.parent / "run").exists()  # nothing written into run.dir, whatever the verdict
    return out


def test_a_good_agent_would_train(tmp_path):
    out = check(project(tmp_path, "good"), "--tasks", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "would train: 6 transitions from 2 groups" in out.stdout
    assert "task 1" in out.stdout and "task 2" in out.stdout and "0.222" in out.stdout  # [1, 0, 0]'s variance


@pytest.mark.parametrize("mode, extra, because", [
    ("no-llm", {}, "no rollout made an LLM call the gateway could attribute to it. Fix: call the run's server"),
    ("greedy", {}, "the agent's LLM calls are greedy (temperature 0): an argmax is not a sample of the policy. "
                   "Fix: sample in its training calls: temperature > 0"),
    ("reward-raises", {}, "every rollout failed (first: @reward raised ZeroDivisionError: division by zero"),
    ("judge", {"rollout": 'timeout = 60.0\ncomponents = ["solver-v2"]'},
     "none of the LLM calls is of rollout.components = ['solver-v2'] (their components: ['judge']). Fix: set "
     "rollout.components"),
    ("flat", {}, "every group's rewards are equal (0.5): GRPO learns from differences within a group. Fix: a "
                 "reward that tells better outputs from worse"),
])
def test_a_broken_agent_would_train_nothing_and_is_told_why(tmp_path, mode, extra, because):
    out = check(project(tmp_path, mode, **extra), "--tasks", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdict = " ".join(lines[lines.index(next(x for x in lines if x.startswith("would train"))):])
    assert verdict.startswith("would train nothing, because " + because), verdict
    if mode == "reward-raises":  # the line of the user's code that raised, from the stored traceback
        line = AGENT.splitlines().index("        return 1 / 0") + 1
        assert f"at agent.py:{line} in score: return 1 / 0). Fix: fix the agent or its @reward" in verdict
    if mode == "greedy":
        assert out.stdout.count("1 greedy") == 3
    if mode == "flat":
        assert "(no signal)" in out.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    config = project(tmp_path, "good")
    config.write_text(config.read_text().replace("group_size = 3", "group_size = 1"))
    out = check(config)
    assert out.returncode == 2 and "data.group_size" in out.stdout and len(out.stdout.strip().splitlines()) == 1
    config = project(tmp_path, "good")
    (tmp_path / "train.jsonl").unlink()
    out = check(config)
    assert out.returncode == 2 and "train.jsonl" in out.stdout
