"""The group baseline counts every scored rollout of a group, also those that left no transition to train
(docs/credit.md rule 1): the math on hand-computed numbers, then a real run whose losers only made greedy calls."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from rich.console import Console

from lightning_sdk import config
from lightning_sdk.runtime import Runtime
from lightning_sdk.train.grpo import group_advantages, single_rollout_groups, zero_variance_groups


def test_rollouts_without_transitions_count_in_the_mean_and_std():
    # outcomes [1, 0, 0, 0]; only a (the winner) and b reached the trained component.
    scored = {"g": {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0}}
    adv = group_advantages([1.0, 0.0, 0.0], ["g"] * 3, ["a", "b", "b"], scored=scored)
    # mean 0.25, Bessel std 0.5: +1.5 and -0.5 (without c and d: +0.707 / -0.707)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25]) / (0.5 + 1e-4))
    assert adv[0].item() == pytest.approx(1.4997, abs=1e-4) and adv[1].item() == pytest.approx(-0.4999, abs=1e-4)


def test_a_group_whose_losers_left_no_transition_is_neither_single_nor_zero_variance():
    scored = {"g": {"a": 1.0, "b": 0.0, "c": 0.0}, "h": {"x": 1.0, "y": 1.0}}
    assert single_rollout_groups(["g", "h"], ["a", "x"], scored) == set()
    assert single_rollout_groups(["g", "h"], ["a", "x"]) == {"g", "h"}  # without the scored rollouts
    assert zero_variance_groups([1.0, 1.0], ["g", "h"], ["a", "x"], scored) == {"h"}
    adv = group_advantages([1.0], ["g"], ["a"], scored=scored)
    assert adv.item() == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 1e-4), rel=1e-6)
    # shaping is bounded by the whole group: a at the group's worst outcome (0) would get A = 0
    adv = group_advantages([1.0], ["g"], ["a"], scored=scored, shaping=[-100.0])
    assert adv.item() == pytest.approx(0.0, abs=1e-6)


def test_a_transition_whose_outcome_the_scored_rollouts_do_not_give_is_refused():
    with pytest.raises(ValueError, match="rollout a: its outcome 1.0"):
        group_advantages([1.0, 0.0], ["g", "g"], ["a", "b"], scored={"g": {"a": 0.5, "b": 0.0}})
    with pytest.raises(ValueError, match="not finite"):
        group_advantages([1.0, 0.0], ["g", "g"], ["a", "b"], scored={"g": {"a": 1.0, "b": 0.0, "c": math.nan}})


AGENT = '''
import threading
from openai import OpenAI
import lightning_sdk as ls

LOCK, SEEN = threading.Lock(), {}

@ls.rollout
def solve(task, llm):
    with LOCK:  # the first rollout of each task samples and wins; the others call greedily and lose
        first = task["question"] not in SEEN
        SEEN[task["question"]] = True
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(model=llm.model, max_tokens=4, temperature=1.0 if first else 0.0,
                                   messages=[{"role": "user", "content": task["question"]}])
    return "win" if first else "lose"

@ls.reward
def score(task, output):
    return 1.0 if output == "win" else 0.0
'''


def run_one_task(tmp_path, agent: str, *, group_size: int, concurrency: int) -> None:
    """One iteration of `agent` (its source) on one task, a group of `group_size`, in this process; run dir run/."""
    (tmp_path / "agent.py").write_text(agent)
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    (tmp_path / "lightning.toml").write_text(
        '[run]\nname = "one"\ndir = "run"\niterations = 1\n[agent]\nmodule = "agent.py"\n'
        f'[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 1\ngroup_size = {group_size}\n'
        f'[model]\ndtype = "float32"\n[rollout]\nconcurrency = {concurrency}\ntimeout = 60.0\n[train]\nlora_r = 4\n')
    Runtime(config.load(tmp_path / "lightning.toml"), console=Console(file=io.StringIO())).run()


def test_a_group_whose_losers_were_greedy_trains_its_winner(tmp_path):
    run_one_task(tmp_path, AGENT, group_size=3, concurrency=1)
    (row,) = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
              if "iteration" in json.loads(line) and json.loads(line).get("phase") != "eval"]
    assert row["rollout/skipped/greedy"] == 2 and row["rollout/transitions"] == 1
    assert row["train/num_transitions"] == 1  # the group [1, 0, 0] is not a single-rollout group
    assert row["train/adv_mean"] == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 1e-4), rel=1e-5)
    assert row["train/grad_norm"] > 0
