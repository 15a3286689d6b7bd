"""Credit assignment: how an episode's reward is shared out over the LLM calls that made it.

A rule is a plain function `(episode_reward, calls) -> one reward per call`; `calls` are the rollout's LLM-call
spans in order (already filtered to the components being trained). Intermediate rewards (`emit_reward`, failed
calls) are added on top by the adapter, whatever the rule.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

from lightning_sdk.tracing import SpanRecord

CreditRule = Callable[[float, Sequence[SpanRecord]], Sequence[float]]


def lightning_rl(episode_reward: float, calls: Sequence[SpanRecord]) -> list[float]:
    """LightningRL: every call of the episode gets the episode reward (advantages are then group-normalised)."""
    return [episode_reward] * len(calls)


def last_call(episode_reward: float, calls: Sequence[SpanRecord]) -> list[float]:
    """Only the final call is credited with the outcome; earlier calls get their intermediate rewards alone."""
    return [0.0] * (len(calls) - 1) + [episode_reward] if calls else []


BUILTIN: dict[str, CreditRule] = {"lightning_rl": lightning_rl, "last_call": last_call}


def resolve(name: str) -> CreditRule:
    """A builtin rule by name, or `package.module:function` for a user's own."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"rollout.credit = {name!r}: expected one of {sorted(BUILTIN)} or 'module:function'")
    module, _, attr = name.partition(":")
    try:
        rule = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.credit = {name!r}: cannot import ({e})") from None
    if not callable(rule):
        raise ValueError(f"rollout.credit = {name!r}: not a function")
    return rule
