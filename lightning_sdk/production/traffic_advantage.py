"""Advantages from production traffic, where no prompt is re-run on purpose: each rewarded episode is one sample.

The estimator (derived in docs/serve.md, "Advantages without re-run groups"):

- Same-prompt group: where n >= 2 rewarded episodes of the window began with the same prompt (its exact token
  ids), episode i takes A_i = R_i - mean_{j != i} R_j (the leave-one-out baseline, RLOO): its baseline does not
  depend on R_i, so it adds no bias to the policy gradient, and it removes what the prompt's difficulty explains.
- Otherwise a running baseline per component: A_i = R_i - b_c, where b_c is an exponential moving average (weight
  `alpha`) of the rewards of the component's episodes whose rewards arrived before this one, then
  b_c <- b_c + alpha * (R_i - b_c). It too is fixed before R_i is seen. A component's first rewarded episode has
  no baseline yet: it gives no signal (A = None), and starts b_c at its reward.

A reply counts once in a leave-one-out baseline: where an episode and its first call are both rewarded (an episode
reward and a call reward), the two samples are one reply (`reply`: the first call), the group's n counts replies, and
a reply with several samples enters the others' baselines with their mean; so no sample's baseline holds its own
reply. A reward that is not a finite number within +-MAX_ABS_REWARD (config.MAX_ABS_REWARD, the bound a run's rewards
have) is refused: that sample gets no advantage (how 'refused') and enters no group and no running baseline, so a
baseline never holds a number far beyond float32's range.

Every other rewarded episode updates its component's running baseline, in the order its reward arrived, so a restart
that reads the same log computes the same numbers. No division by a standard deviation: a running std from a
handful of episodes is noisier than the reward itself; advantages stay in reward units.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from lightning_sdk.config import MAX_ABS_REWARD

DEFAULT_ALPHA = 0.1


@dataclass(frozen=True)
class Rewarded:
    """One rewarded episode, in the order its reward arrived: `prompt` names its first prompt (its token ids)."""

    episode: str
    prompt: str
    component: str
    reward: float
    reply: str = ""  # its first call's id ("": the episode is a reply of its own)


def admissible(reward: float) -> bool:
    """Whether a sample's reward may enter the estimate: a finite number within +-MAX_ABS_REWARD."""
    return math.isfinite(reward) and abs(reward) <= MAX_ABS_REWARD


def leave_one_out(rewards: Sequence[tuple[str, float]]) -> tuple[dict[str, float], float]:
    """A same-prompt group's (reply, reward) pairs in order -> each reply's value (the mean of its samples' rewards)
    and the sum of the values (in the order replies first appear): a sample of reply r has the baseline
    (total - value[r]) / (len(value) - 1)."""
    by_reply: dict[str, list[float]] = {}
    for reply, reward in rewards:
        by_reply.setdefault(reply, []).append(reward)
    value = {r: sum(v) / len(v) for r, v in by_reply.items()}
    return value, sum(value.values())


@dataclass(frozen=True)
class Estimate:
    episode: str
    advantage: float | None  # None: no baseline yet (a component's first episode): left out, counted
    baseline: float | None
    how: str  # 'group' (leave-one-out over n same-prompt replies) | 'running' | 'none' | 'refused'
    group_size: int


def estimate(episodes: Sequence[Rewarded], *, alpha: float = DEFAULT_ALPHA) -> list[Estimate]:
    """One estimate per episode, in order (see the module docstring)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha = {alpha!r}: expected 0 < alpha <= 1")
    kept = [e for e in episodes if admissible(e.reward)]
    by_prompt: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for e in kept:
        by_prompt[e.prompt].append((e.reply or e.episode, e.reward))
    groups = {p: leave_one_out(g) for p, g in by_prompt.items()}
    running: dict[str, float] = {}
    out = []
    for e in episodes:
        if not admissible(e.reward):
            out.append(Estimate(e.episode, None, None, "refused", 0))
            continue
        value, total = groups[e.prompt]
        before = running.get(e.component)
        if len(value) >= 2:
            baseline = (total - value[e.reply or e.episode]) / (len(value) - 1)
            out.append(Estimate(e.episode, e.reward - baseline, baseline, "group", len(value)))
        elif before is not None:
            out.append(Estimate(e.episode, e.reward - before, before, "running", 1))
        else:
            out.append(Estimate(e.episode, None, None, "none", 1))
        running[e.component] = e.reward if before is None else before + alpha * (e.reward - before)
    return out
