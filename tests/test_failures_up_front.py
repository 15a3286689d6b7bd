"""Failures said where a person looks first: `lightning eval` counts its failed rollouts and says why in its one
score line and in metrics.jsonl; a stop line groups near-identical errors and stays one bounded line; a reward that
returns None, a module without @reward and one with two each get the fix for that case."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from lightning_sdk.agent import RewardError, load_agent, reward_value
from lightning_sdk.errors import SetupError
from lightning_sdk.evals import EvalScore
from lightning_sdk.failures import summary
from lightning_sdk.metrics import eval_row
from lightning_sdk.runtime import Runtime
from tests.test_runtime_faults import make_project, task

ROOT = Path(__file__).resolve().parents[1]


def test_a_reward_returning_none_is_told_it_returned_none_not_that_it_raised():
    with pytest.raises(RewardError) as e:
        reward_value(None, "@reward returned", " for rollout it0001-000-0-abcdef12")
    assert str(e.value).startswith("@reward returned None for rollout it0001-000-0-abcdef12, expected a float: "
                                   "return a number (or a bool) on every path")
    assert "raise" not in str(e.value) and "finite float" not in str(e.value)


def test_no_reward_and_two_rewards_get_different_advice(tmp_path):
    (tmp_path / "none.py").write_text("import lightning_sdk as ls\n@ls.rollout\ndef solve(task):\n    return 1\n")
    (tmp_path / "two.py").write_text("import lightning_sdk as ls\n@ls.rollout\ndef solve(task):\n    return 1\n"
                                     "@ls.reward\ndef a(task, out):\n    return 1.0\n"
                                     "@ls.reward\ndef b(task, out):\n    return 1.0\n")
    with pytest.raises(SetupError) as none:
        load_agent(str(tmp_path / "none.py"), None, None)
    assert "has no @reward function; mark the function that scores an episode with @ls.reward" in str(none.value)
    assert "agent.reward" not in str(none.value)
    with pytest.raises(SetupError) as two:
        load_agent(str(tmp_path / "two.py"), None, None)
    assert "has 2 @reward functions (a, b); name the one to use with agent.reward = 'a' in [agent]" in str(two.value)


def test_an_exception_dump_becomes_one_bounded_line_with_the_users_file_and_line():
    """An instructor-style failure: its message embeds three exception dumps (thousands of characters, many lines);
    a batch of them is one short line, counted, with where the user's code raised."""
    dump = "InstructorRetryException: <failed_attempts>\n" + "\n".join(
        f"<exception>{'ValidationError: 1 validation error for Answer ' * 40}</exception>" for _ in range(3))
    assert len(dump) > 5000
    tb = ('Traceback (most recent call last):\n  File "/site/lib/python3.11/site-packages/instructor/retry.py", '
          'line 10, in retry\n    raise X\n  File "/home/me/agent.py", line 42, in solve\n    return client.create()\n')
    line = summary([(dump, tb)] * 3 + [("TimeoutError: rollout it0001-000-1-0123abcd took longer", None)])
    assert "\n" not in line and len(line) < 400, line
    assert line.startswith("3 x InstructorRetryException: <failed_attempts> (agent.py:42 in solve); "
                           "1 x TimeoutError: rollout <rollout> took longer"), line


def test_an_eval_with_failed_rollouts_says_so_in_its_line_and_its_metrics_row(tmp_path):
    rows = [task(1, 2), task(2, 2, "nan"), task(3, 2, "nan"), task(4, 2)]
    cfg = make_project(tmp_path, rows)
    out = io.StringIO()
    score = Runtime(cfg, console=Console(file=out, width=300)).evaluate(rows).score
    assert score.failed == 2 and score.n == 4
    assert score.failures.startswith("2 x RewardError: @reward returned nan (float) for rollout <rollout>")
    assert "over 4 tasks" not in out.getvalue()  # `lightning eval` prints the one score line itself
    row = eval_row("trained", score, 2)
    assert row["eval/failed"] == 2 and row["eval/failures"] == score.failures
    assert score.failed_words.startswith("; 2 of 4 rollouts FAILED and scored 0: 2 x RewardError")
    assert eval_row("trained", EvalScore.of([1.0, 0.0]), 2)["eval/failed"] == 0


def test_lightning_eval_prints_its_score_once_with_its_failures(tmp_path):
    rows = [task(1, 2), task(2, 2, "nan")]
    make_project(tmp_path, rows)
    (tmp_path / "lightning.toml").write_text((tmp_path / "lightning.toml").read_text().replace(
        'train = "train.jsonl"', 'train = "train.jsonl"\neval = "train.jsonl"'))
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "eval"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [x for x in out.stdout.splitlines() if "over 2 tasks" in x]
    assert len(lines) == 1, out.stdout
    assert "; 1 of 2 rollouts FAILED and scored 0: 1 x RewardError: @reward returned nan" in lines[0]


def test_a_greedy_agents_run_says_the_same_verdict_and_fix_as_check():
    """The run's stop line for an iteration with nothing to train gives check's reason and fix, not a legend of
    every reason's abbreviation."""
    from collections import Counter

    from lightning_sdk.runtime import nothing_to_train

    line = nothing_to_train(["r1", "r2"], Counter({"greedy": 2}), 0, [])
    assert line == ("no transitions from 2 rollouts: the agent's LLM calls are greedy (temperature 0): an argmax is "
                    "not a sample of the policy (left out: 2 greedy). Fix: sample in its training calls: "
                    "temperature > 0, e.g. 1.0. `lightning check` shows each rollout")
    assert "n>1: several choices" not in line
