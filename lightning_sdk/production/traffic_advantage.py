"""Advantages from production traffic, where no prompt is re-run on purpose: each rewarded episode is one sample.

The estimator (derived in docs/serve.md, "Advantages without re-run groups"):

- Same-prompt group: where n >= 2 rewarded episodes of the window began with the same prompt (its exact token
  ids), episode i takes A_i = R_i - mean_{j != i} R_j (the leave-one-out baseline, RLOO): its baseline does not
  depend on R_i, so it adds no bias to the policy gradient, and it removes what the prompt's difficulty explains.
- Otherwise a running baseline per component: A_i = R_i - b_c, where b_c is an exponential moving average (weight
  `alpha`) of the rewards of the component's episodes whose rewards arrived before this one, then
  b_c <- b_c + alpha * (R_i - b_c). It too is fixed before R_i is seen. A component's first rewarded episode has
  no baseline yet: it gives no signal (A = None), and starts b_c at its reward.

Every rewarded episode updates its component's running baseline, in the order its reward arrived, so a restart
that reads the same log computes the same numbers. No division by a standard deviation: a running std from a
handful of episodes is noisier than the reward itself; advantages stay in reward units.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

DEFAULT_ALPHA = 0.1


@dataclass(frozen=True)
class Rewarded:
    """One rewarded episode, in the order its reward arrived: `prompt` names its first prompt (its token ids)."""

    episode: str
    prompt: str
    component: str
    reward: float


@dataclass(frozen=True)
class Estimate:
    episode: str
    advantage: float | None  # None: no baseline yet (a component's first episode): left out, counted
    baseline: float | None
    how: str  # 'group' (leave-one-out over n same-prompt episodes) | 'running' | 'none'
    group_size: int


def estimate(episodes: Sequence[Rewarded], *, alpha: float = DEFAULT_ALPHA) -> list[Estimate]:
    """One estimate per episode, in order (see the module docstring)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha = {alpha!r}: expected 0 < alpha <= 1")
    bad = [e.episode for e in episodes if not math.isfinite(e.reward)]
    if bad:
        raise ValueError(f"episode {bad[0]}: reward is not a finite number")
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        by_prompt[e.prompt].append(e.reward)
    running: dict[str, float] = {}
    out = []
    for e in episodes:
        group = by_prompt[e.prompt]
        before = running.get(e.component)
        if len(group) >= 2:
            baseline = (sum(group) - e.reward) / (len(group) - 1)
            out.append(Estimate(e.episode, e.reward - baseline, baseline, "group", len(group)))
        elif before is not None:
            out.append(Estimate(e.episode, e.reward - before, before, "running", 1))
        else:
            out.append(Estimate(e.episode, None, None, "none", 1))
        running[e.component] = e.reward if before is None else before + alpha * (e.reward - before)
    return out
