"""From the log to advantages: the rewarded episodes of a `lightning serve` store, in the order their rewards
arrived, and each rewarded call's advantage (traffic_advantage.estimate, shared over an episode's calls by the
credit rule as in a run). The numbers are traffic_advantage.estimate's over every rewarded sample still stored;
reward_log.RewardLog keeps them up to date as rewards arrive.

An episode reward (by episode id) makes the episode one sample; a reward for one call (by call or response id)
makes that call a sample of its own. Several rewards of the same name for one sample add up. A sample's prompt is
the exact prompt token ids of its first call; its component is that call's (none: ""). Advantages are keyed by
(sample, call): a call rewarded by its id and as part of its episode is two samples, each with its own advantage
(and one reply in a leave-one-out baseline: traffic_advantage).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sdk.credit import CreditRule
from lightning_sdk.production.reward_log import RewardLog
from lightning_sdk.production.traffic_advantage import DEFAULT_ALPHA
from lightning_sdk.store import Store


@dataclass(frozen=True)
class CallAdvantages:
    by_sample: dict[tuple[str, str], float]  # (sample, call id) -> advantage (credit weight x the sample's)
    no_baseline: int  # samples left out: their component had no baseline yet
    refused: int = 0  # samples left out: their reward is not a finite number within +-MAX_ABS_REWARD

    @property
    def by_call(self) -> dict[str, float]:
        """Call id -> the sum of its (sample, call) advantages: what the call is pushed by over the whole log."""
        out: dict[str, float] = {}
        for (_, call), a in self.by_sample.items():
            out[call] = out.get(call, 0.0) + a
        return out


def call_advantages(store: Store, rule: CreditRule, name: str = "reward",
                    alpha: float = DEFAULT_ALPHA) -> CallAdvantages:
    """Every rewarded (sample, call)'s advantage over the whole log of `store` (its feedback and calls), read once
    (reward_log.RewardLog: a learner keeps one and refreshes it instead)."""
    log = RewardLog(store, rule, name, alpha)
    try:
        log.refresh()
        by_sample, none = log.everything()
        refused = log.refused()
    finally:
        log.close()
    return CallAdvantages(by_sample, none, refused)
