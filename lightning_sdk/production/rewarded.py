"""From the log to advantages: the rewarded episodes of a `lightning serve` store, in the order their rewards
arrived, and each rewarded call's advantage (traffic_advantage.estimate, shared over an episode's calls by the
credit rule as in a run). The numbers are traffic_advantage.estimate's over every rewarded sample still stored;
reward_log.RewardLog keeps them up to date as rewards arrive.

An episode reward (by episode id) makes the episode one sample; a reward for one call (by call or response id)
makes that call a sample of its own. Several rewards of the same name for one sample add up. A sample's prompt is
the exact prompt token ids of its first call; its component is that call's (none: "").
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sdk.credit import CreditRule
from lightning_sdk.production.reward_log import RewardLog
from lightning_sdk.production.traffic_advantage import DEFAULT_ALPHA
from lightning_sdk.store import Store


@dataclass(frozen=True)
class CallAdvantages:
    by_call: dict[str, float]  # call id -> advantage (credit weight x the sample's)
    no_baseline: int  # samples left out: their component had no baseline yet


def call_advantages(store: Store, rule: CreditRule, name: str = "reward",
                    alpha: float = DEFAULT_ALPHA) -> CallAdvantages:
    """Every rewarded call's advantage over the whole log of `store` (its feedback and calls), read once (reward_log.RewardLog: a
    learner keeps one and refreshes it instead)."""
    log = RewardLog(store, rule, name, alpha)
    try:
        log.refresh()
        by_call, none = log.everything()
    finally:
        log.close()
    return CallAdvantages(by_call, none)
