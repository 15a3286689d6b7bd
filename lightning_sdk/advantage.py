"""The advantage each LLM call is trained with, in plain Python (no torch): the trainer wraps it in a tensor
(train.grpo.group_advantages) and the dashboard shows how it was made, so both read the same numbers.

docs/credit.md states the rule; TRL's scale_rewards and verl's norm_adv_by_std_in_grpo are its equivalents.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

STD_EPS = 1e-4  # added to the std before dividing (TRL's convention)
SCALES = ("group", "batch", "none")

# group id -> {rollout id: outcome} of EVERY scored rollout of the group, those that left no transition (all their
# calls greedy, failed or of another component) included: the baseline is the group's, not the trained calls'.
GroupOutcomes = Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class Advantage:
    """One call's advantage and its parts: value = credit * (outcome - group_mean) / divisor + shaping_term."""

    value: float
    outcome: float  # the rollout's episode reward
    group_size: int  # scored rollouts in its group
    group_mean: float | None  # None: the group gives no signal (one rollout, or every outcome equal)
    group_std: float | None  # Bessel-corrected
    divisor: float | None  # group std + STD_EPS, the batch's std + STD_EPS, or 1 (train.scale_rewards)
    rollout_advantage: float  # (outcome - group_mean) / divisor: every call of the rollout shares it
    credit: float  # the call's share of it (credit rule, >= 0)
    shaping: float  # the intermediate rewards credited to the call, in reward units
    shaping_term: float  # shaping / divisor, bounded by what failing or succeeding outright would change


def _mean(x: Sequence[float]) -> float:
    return sum(x) / len(x)


def _std(x: Sequence[float]) -> float:
    # Squares, not exact fractions: rewards whose square overflows give inf, which group_advantages refuses.
    m = _mean(x)
    return math.sqrt(sum((v - m) * (v - m) for v in x) / (len(x) - 1)) if len(x) > 1 else math.nan


def group_outcomes(outcomes: Sequence[float], group_ids: Sequence[str], rollout_ids: Sequence[str],
                   scored: GroupOutcomes | None = None) -> dict[str, tuple[list[str], list[float]]]:
    """group -> (its rollouts, their outcomes): the transitions' rollouts in first-seen order, or, with `scored`,
    every scored rollout of each group the transitions touch. Every transition of a rollout must carry the same
    outcome: the episode reward is the rollout's, not the call's."""
    per: dict[str, float] = {}
    members: dict[str, list[str]] = defaultdict(list)
    for r, g, rid in zip((float(v) for v in outcomes), group_ids, rollout_ids):
        if rid not in per:
            per[rid] = r
            members[g].append(rid)
        elif per[rid] != r:
            raise ValueError(f"rollout {rid}: its transitions carry different episode rewards ({per[rid]} and {r});"
                             f" intermediate rewards belong in Transition.shaping")
    if scored is not None:
        for g, rids in members.items():
            everyone = scored.get(g, {})
            for rid in rids:
                if rid not in everyone or float(everyone[rid]) != per[rid]:
                    raise ValueError(f"rollout {rid}: its outcome {per[rid]} is not the one the scored rollouts of "
                                     f"group {g} give it ({everyone.get(rid)})")
            for rid, r in everyone.items():
                if not math.isfinite(float(r)):
                    raise ValueError(f"group_advantages: rollout {rid}'s outcome {r} is not finite")
                per[rid] = float(r)
            members[g] = list(everyone)
    return {g: (rids, [per[r] for r in rids]) for g, rids in members.items()}


def zero_variance_groups(outcomes: Sequence[float], group_ids: Sequence[str], rollout_ids: Sequence[str],
                         scored: GroupOutcomes | None = None) -> set[str]:
    """Groups of two or more rollouts whose episode rewards are all equal: they carry no GRPO signal."""
    return {g for g, (rids, x) in group_outcomes([float(v) for v in outcomes], group_ids, rollout_ids, scored).items()
            if len(rids) > 1 and max(x) == min(x)}


def single_rollout_groups(group_ids: Sequence[str], rollout_ids: Sequence[str],
                          scored: GroupOutcomes | None = None) -> set[str]:
    """Groups with one scored rollout (with `scored`; else one rollout among the transitions): no baseline."""
    seen: dict[str, set[str]] = defaultdict(set)
    for g, rid in zip(group_ids, rollout_ids):
        seen[g].add(rid)
    return {g for g, rids in seen.items() if len(scored[g] if scored is not None and g in scored else rids) < 2}


@dataclass(frozen=True)
class BatchAdvantages:
    """What an update trains: which transitions of the batch, and each one's advantage."""

    kept: list[int]  # indices into the batch: groups with a baseline (and a signal, when dropping all-equal ones)
    advantages: list[Advantage]  # one per kept transition
    zero_variance_frac: float  # of the groups with a baseline, those whose outcomes are all equal
    dropped: set[str]  # the groups left out: one scored rollout, or all-equal under drop_zero_variance


def batch_advantages(outcomes: Sequence[float], group_ids: Sequence[str], rollout_ids: Sequence[str],
                     scale: str = "group", *, credit: Sequence[float] | None = None,
                     shaping: Sequence[float] | None = None, scored: GroupOutcomes | None = None,
                     drop_zero_variance: bool = False) -> BatchAdvantages:
    """The trainer's advantages for one batch (GRPOTrainer and the dashboard both call this): groups with one
    rollout are left out, then, with `drop_zero_variance` (train.drop_zero_variance_groups), the groups whose
    outcomes are all equal, before the advantages (and with scale "batch" the batch's std) are computed."""
    n = len(group_ids)
    single = single_rollout_groups(group_ids, rollout_ids, scored)
    kept = [i for i in range(n) if group_ids[i] not in single]

    def pick(v: Sequence[float] | None) -> list[float] | None:
        return None if v is None else [float(v[i]) for i in kept]

    zero = zero_variance_groups(pick(outcomes), [group_ids[i] for i in kept], [rollout_ids[i] for i in kept], scored)
    frac = len(zero) / len({group_ids[i] for i in kept}) if kept else 0.0
    dropped = single | (zero if drop_zero_variance else set())
    kept = [i for i in kept if group_ids[i] not in dropped]
    explained = explain_advantages(pick(outcomes), [group_ids[i] for i in kept], [rollout_ids[i] for i in kept],
                                   scale, credit=pick(credit), shaping=pick(shaping), scored=scored) if kept else []
    return BatchAdvantages(kept, explained, frac, dropped)


def explain_advantages(
    outcomes: Sequence[float],
    group_ids: Sequence[str],
    rollout_ids: Sequence[str],
    scale: str = "group",
    *,
    credit: Sequence[float] | None = None,
    shaping: Sequence[float] | None = None,
    scored: GroupOutcomes | None = None,
) -> list[Advantage]:
    """One advantage per transition (LLM call), from its rollout's outcome and its own intermediate rewards.

    1. Each rollout r of a group gets A_r = (R_r - mean_g R) / d, over *rollouts* (however many calls each made):
       d = the group's std (Bessel, + 1e-4; TRL's scale_rewards="group"), the batch's std ("batch") or 1 ("none").
    2. Call k of rollout r gets credit_k * A_r (credit_k >= 0 from the credit rule: no call goes negative from its
       position alone) plus its shaping s_k / d, the shaping limited to what the rollout failing (succeeding)
       outright would do to A_r: it stays within [A_r(R_r -> worst R in group) - A_r, A_r(R_r -> best) - A_r].
    Groups with one rollout, or whose outcomes are all equal, give 0 to every call, shaping included: intermediate
    rewards alone never make a training signal. `scored` gives every scored rollout's outcome per group: the mean,
    the std and "one rollout" then count the rollouts that left no transition too (docs/credit.md rule 1).
    """
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: expected one of {SCALES}")
    n_t = len(group_ids)
    out_v = [float(v) for v in outcomes]
    c = [1.0] * n_t if credit is None else [float(v) for v in credit]
    s = [0.0] * n_t if shaping is None else [float(v) for v in shaping]
    if any(v < 0 for v in c):
        raise ValueError("credit weights must be >= 0 (a call's share of its rollout's advantage)")
    # One nan or inf here would make every advantage, the loss and then every adapter tensor non-finite.
    for name, v in (("outcomes", out_v), ("credit", c), ("shaping", s)):
        for i, x in enumerate(v):
            if not math.isfinite(x):
                raise ValueError(f"group_advantages: {name}[{i}] = {x} (rollout {rollout_ids[i]}) is not finite")
    groups = group_outcomes(out_v, group_ids, rollout_ids, scored)
    live = {g: v for g, v in groups.items() if len(v[0]) > 1}
    batch_d = 1.0
    if scale == "batch" and live:
        every = [r for _, x in live.values() for r in x]
        batch_d = (_std(every) if len(every) > 1 else 0.0) + STD_EPS

    def adv(x: list[float]) -> list[float]:  # the advantages of outcomes x of one group
        m = _mean(x)
        d = _std(x) + STD_EPS if scale == "group" else batch_d if scale == "batch" else 1.0
        return [(v - m) / d for v in x]

    # rollout -> (A_r, shaping's (lowest, highest) shift of A_r, divisor, group mean, group std, group size)
    per: dict[str, tuple[float, tuple[float, float], float, float, float]] = {}
    size = {rid: len(rids) for rids, _ in groups.values() for rid in rids}
    for g, (rids, x) in live.items():
        if max(x) == min(x):
            continue
        a = adv(x)
        d = _std(x) + STD_EPS if scale == "group" else batch_d
        if not math.isfinite(d):  # rewards near 1e154 and beyond (agent.MAX_ABS_REWARD keeps them out)
            raise ValueError(f"group_advantages: group {g}'s rewards {x} are too large: their std "
                             f"overflows, which would make every advantage 0")
        for j, rid in enumerate(rids):
            worst, best = list(x), list(x)
            worst[j], best[j] = min(x), max(x)
            per[rid] = (a[j], (adv(worst)[j] - a[j], adv(best)[j] - a[j]), d, _mean(x), _std(x))
    out = []
    for i, rid in enumerate(rollout_ids):
        if rid not in per:
            out.append(Advantage(0.0, out_v[i], size.get(rid, 1), None, None, None, 0.0, c[i], s[i], 0.0))
            continue
        base, (lo, hi), d, mean, std = per[rid]
        term = min(max(s[i] / d, lo), hi)
        value = c[i] * base + term
        if not math.isfinite(value):
            raise ValueError("group_advantages: an advantage overflowed; rewards of this size cannot be normalised")
        out.append(Advantage(value, out_v[i], size[rid], mean, std, d, base, c[i], s[i], term))
    return out


def group_advantages(outcomes: Sequence[float], group_ids: Sequence[str], rollout_ids: Sequence[str],
                     scale: str = "group", *, credit: Sequence[float] | None = None,
                     shaping: Sequence[float] | None = None, scored: GroupOutcomes | None = None) -> list[float]:
    """The advantages alone (explain_advantages(...)[i].value)."""
    return [a.value for a in explain_advantages(outcomes, group_ids, rollout_ids, scale, credit=credit,
                                                shaping=shaping, scored=scored)]


__all__ = ["Advantage", "BatchAdvantages", "GroupOutcomes", "SCALES", "STD_EPS", "batch_advantages",
           "explain_advantages", "group_advantages", "group_outcomes", "single_rollout_groups", "zero_variance_groups"]
