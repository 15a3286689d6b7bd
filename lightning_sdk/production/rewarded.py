"""From the log to advantages: the rewarded episodes of a `lightning serve` store, in the order their rewards
arrived, and each rewarded call's advantage (traffic_advantage.estimate, shared over an episode's calls by the
credit rule as in a run).

An episode reward (by episode id) makes the episode one sample; a reward for one call (by call or response id)
makes that call a sample of its own. Several rewards of the same name for one sample add up. A sample's prompt is
the exact prompt token ids of its first call; its component is that call's (none: "").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from lightning_sdk.credit import CreditRule, weights
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.production.traffic_advantage import DEFAULT_ALPHA, Rewarded, estimate
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import GATEWAY, PROMPT_IDS, SpanRecord


@dataclass(frozen=True)
class CallAdvantages:
    by_call: dict[str, float]  # call id -> advantage (credit weight x the sample's)
    no_baseline: int  # samples left out: their component had no baseline yet


def prompt_key(call: SpanRecord) -> str:
    return hashlib.sha256(json.dumps(call.attributes.get(PROMPT_IDS)).encode()).hexdigest()


def call_advantages(ledger: FeedbackLedger, store: Store, rule: CreditRule, name: str = "reward",
                    alpha: float = DEFAULT_ALPHA) -> CallAdvantages:
    samples: dict[str, list[SpanRecord]] = {}
    rewards: dict[str, float] = {}
    for row in ledger.rows(name):
        key = row["rollout_id"] if row["kind"] == "episode_id" else row["call_id"]
        if key not in samples:
            calls = [s for s in store.spans(row["rollout_id"] or "") if s.source == GATEWAY]
            samples[key] = calls if row["kind"] == "episode_id" else [c for c in calls if c.span_id == key]
        rewards[key] = rewards.get(key, 0.0) + row["value"]
    episodes = [Rewarded(key, prompt_key(calls[0]), calls[0].component or "", rewards[key])
                for key, calls in samples.items() if calls]
    by_call: dict[str, float] = {}
    left_out = 0
    for est in estimate(episodes, alpha=alpha):
        if est.advantage is None:
            left_out += 1
            continue
        calls = samples[est.episode]
        for call, w in zip(calls, weights(rule, calls)):
            by_call[call.span_id] = by_call.get(call.span_id, 0.0) + w * est.advantage
    return CallAdvantages(by_call, left_out)
