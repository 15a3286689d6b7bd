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
import threading, time
from openai import OpenAI
import lightning_sdk as ls

LOCK, SEEN = threading.Lock(), set()
MODE = "{mode}"

class Shared:
    """Per-run state kept on one object built at import, as some agent frameworks do: not safe in threads."""

    def run(self, task):
        self.task = task
        time.sleep(0.2)  # another rollout's thread overwrites self.task meanwhile
        if self.task is not task:
            raise RuntimeError("state of another rollout")
        return task["answer"]


AGENT_OBJECT = Shared()


@ls.rollout
def solve(task, llm):
    if MODE == "no-llm":
        return task["answer"]  # answered from a rule: no call
    if MODE == "some-raise" and task["question"].startswith("What is 0"):
        raise RuntimeError("agent blew up on " + task["question"])
    with LOCK:
        first = task["question"] not in SEEN
        SEEN.add(task["question"])
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    with ls.component("judge" if MODE == "judge" else "solver"):
        client.chat.completions.create(model=llm.model, max_tokens=4, temperature=0.0 if MODE == "greedy" else 1.0,
                                       messages=[{{"role": "user", "content": task["question"]}}])
    if MODE == "thread-unsafe":
        AGENT_OBJECT.run(task)
    return "win" if first else "lose"

@ls.reward
def score(task, output):
    if MODE == "reward-raises":
        return 1 / 0
    if MODE == "reward-none":
        if output == "win":
            return 1.0
        return  # a path without a value: the reward returns None
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
    assert "FAILED" not in out.stdout
    assert "0.222" in out.stdout  # [1, 0, 0]'s variance
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert sum(_task_id(row) in out.stdout for row in rows) == 2  # grouped by task id: the two tasks run
    assert "solver" in out.stdout and "components" in out.stdout and "tool spans" in out.stdout
    assert "memory:" not in out.stdout  # the tiny model fits this machine: no memory line


def test_a_run_that_would_not_fit_is_one_memory_line_and_the_check_goes_on(tmp_path):
    """The pre-flight's memory estimate (runtime/preflight.py): a pass of a million rows of the model's whole
    context cannot fit this machine's RAM; one line says so and names the setting, and the check still runs."""
    out = check(project(tmp_path, "good"), "--tasks", "1", "--set", "train.micro_batch_size=1000000")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("memory: ")]
    assert len(lines) == 1, out.stdout
    assert "train.micro_batch_size = 1000000 rows a pass, needs about" in lines[0]
    assert "of this machine's RAM's" in lines[0] and "it fits with " in lines[0]
    assert "would train: " in out.stdout


def _task_id(task: dict) -> str:
    from lightning_sdk.data import task_id

    return task_id(task)


def _verdict(out: subprocess.CompletedProcess) -> str:
    lines = out.stdout.splitlines()
    return " ".join(lines[lines.index(next(x for x in lines if x.startswith("would train"))):])


def test_failed_rollouts_are_named_in_the_verdict_and_exit_3(tmp_path):
    """A quarter of the rollouts raise: it would still train, but the verdict counts them, names the first error
    with its file:line and the fix, and the exit status says so (3, documented in --help)."""
    out = check(project(tmp_path, "some-raise"), "--tasks", "4")
    assert out.returncode == 3, out.stdout + out.stderr
    verdict = _verdict(out)
    line = AGENT.splitlines().index('        raise RuntimeError("agent blew up on " + task["question"])') + 1
    assert verdict.startswith("would train: ") and "; 3 of 12 rollouts FAILED (3 x RuntimeError: agent blew up " \
        f"on What is 0 + 1? (agent.py:{line} in solve)) and would be skipped. Fix: fix the agent where it raised " \
        f"(agent.py:{line} in solve)" in verdict, verdict
    assert verdict.count("RuntimeError") == 1  # one summary, not one message per rollout
    help_text = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "check", "--help"], capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "3 it would train, but some" in " ".join(help_text.split())


def test_a_thread_unsafe_agent_is_detected_and_told_to_run_in_processes(tmp_path):
    """Rollouts in threads share the agent's import-time object: they fail at rollout.concurrency 6 and succeed
    one at a time; check says so and names run.runtime = "processes"."""
    out = check(project(tmp_path, "thread-unsafe", rollout="timeout = 60.0\nconcurrency = 6"), "--tasks", "2")
    verdict = _verdict(out)
    assert out.returncode in (1, 3), out.stdout + out.stderr
    assert "RuntimeError: state of another rollout" in verdict
    assert "succeeded when run again one at a time: the agent is not safe to run in threads at " \
           "rollout.concurrency = 6" in verdict and 'Fix: run.runtime = "processes"' in verdict, verdict


@pytest.mark.parametrize("mode, extra, because", [
    ("no-llm", {}, "no rollout made an LLM call the gateway could attribute to it. Fix: call the run's server"),
    ("greedy", {}, "the agent's LLM calls are greedy (temperature 0): an argmax is not a sample of the policy. "
                   "Fix: sample in its training calls: temperature > 0"),
    ("reward-raises", {}, "every rollout failed (3 x @reward raised ZeroDivisionError: division by zero"),
    ("reward-none", {}, "no group has two scored rollouts; 2 of 3 rollouts FAILED (2 x RewardError: @reward "
                        "returned None for rollout <rollout>, expected a float"),
    ("judge", {"rollout": 'timeout = 60.0\ncomponents = ["solver-v2"]'},
     "none of the LLM calls is of rollout.components = ['solver-v2'] (their components: ['judge']). Fix: set "
     "rollout.components"),
    ("flat", {}, "every group's rewards are equal (0.5): GRPO learns from differences within a group. Fix: a "
                 "reward that tells better outputs from worse"),
])
def test_a_broken_agent_would_train_nothing_and_is_told_why(tmp_path, mode, extra, because):
    out = check(project(tmp_path, mode, **extra), "--tasks", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    verdict = _verdict(out)
    assert verdict.startswith("would train nothing, because " + because), verdict
    if mode == "reward-raises":  # the line of the user's code that raised, from the stored traceback
        line = AGENT.splitlines().index("        return 1 / 0") + 1
        assert f"(agent.py:{line} in score)). Fix: fix @reward where it raised (agent.py:{line} in score)" in verdict
    if mode == "reward-none":  # it did not raise: the fix says what to return, not where it raised
        assert "Fix: make @reward return a float on every path" in verdict and "raised" not in verdict
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


def test_a_thread_unsafe_agent_trains_cleanly_in_worker_processes(tmp_path):
    """The same agent with run.runtime = "processes" (set on the command line): every rollout in a local worker
    process of its own, rollout.concurrency of them at once; none fails, the workers stop with the check."""
    config = project(tmp_path, "thread-unsafe", rollout="timeout = 60.0\nconcurrency = 6")
    out = check(config, "--tasks", "2", "--set", 'run.runtime="processes"')
    assert "rollouts in 6 worker processes" in out.stdout and "FAILED" not in out.stdout, out.stdout + out.stderr
    # Every rollout succeeded. The agent's SEEN set is per process now, so which rollouts score 1 depends on which
    # worker claimed which: the verdict is about the rewards either way, never a failure.
    verdict = _verdict(out)
    assert "failed" not in verdict.lower() and out.returncode in (0, 1), verdict
    assert "6 rollouts of" in out.stdout and out.stdout.count("check-00") == 6
