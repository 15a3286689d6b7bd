"""Credit assignment: how much of its rollout's advantage each LLM call of the rollout takes.

A rule is a plain function `calls -> one weight per call`, each >= 0; `calls` are the rollout's trained LLM-call
spans in order. The trainer gives call k `weight_k * A_r`, A_r the rollout's group-normalised advantage, so a
rule can only share out the outcome's push, never turn its sign: no call of a winning rollout is pushed down for
its position. Intermediate rewards (`emit_reward`, failed tools) are per-call shaping on top (docs/credit.md).
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

from lightning_sdk.tracing import SpanRecord

CreditRule = Callable[[Sequence[SpanRecord]], Sequence[float]]


def lightning_rl(calls: Sequence[SpanRecord]) -> list[float]:
    """LightningRL: every call of the episode takes the whole episode advantage."""
    return [1.0] * len(calls)


def last_call(calls: Sequence[SpanRecord]) -> list[float]:
    """Only the final call takes the outcome; earlier calls train on their intermediate rewards alone."""
    return [0.0] * (len(calls) - 1) + [1.0] if calls else []


BUILTIN: dict[str, CreditRule] = {"lightning_rl": lightning_rl, "last_call": last_call}


def weights(rule: CreditRule, calls: Sequence[SpanRecord]) -> list[float]:
    """The rule's weights for `calls`, checked: one finite weight >= 0 per call."""
    out = [float(w) for w in rule(calls)]
    if len(out) != len(calls):
        raise ValueError(f"credit rule returned {len(out)} weights for {len(calls)} calls")
    bad = [w for w in out if not (w >= 0 and w != float("inf"))]
    if bad:
        raise ValueError(f"credit rule returned weight {bad[0]!r}: expected a finite number >= 0 per call")
    return out


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
