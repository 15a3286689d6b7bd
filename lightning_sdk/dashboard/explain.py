"""How a training rollout's calls got their advantages, for the dashboard: the trainer's own steps
(transitions.to_transitions, then advantage.batch_advantages, the trainer's computation) replayed over the store.

The trainer computes advantages over a whole iteration; with train.scale_rewards "group" or "none" a call's
advantage depends on its group alone, so only the group is read; with "batch" the whole iteration is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_sdk.advantage import Advantage, batch_advantages
from lightning_sdk.credit import CreditRule
from lightning_sdk.errors import CaptureError
from lightning_sdk.store import RolloutRecord, Store
from lightning_sdk.transitions import Transition, to_transitions

MAX_SCOPE = 5000  # rollouts read for one explanation (an iteration is far smaller)


@dataclass(frozen=True)
class Scoring:
    """The run's settings that shape an advantage (rollout.credit, rollout.components, rollout.error_reward,
    train.scale_rewards)."""

    rule: CreditRule
    rule_name: str
    components: tuple[str, ...]
    error_reward: float
    scale: str
    failed_reward: float | None = None  # rollout.failed_reward
    drop_zero_variance: bool = False  # train.drop_zero_variance_groups


@dataclass
class Explained:
    """What the page shows: each trained call's advantage (by span id), the group's rollouts, or why none."""

    advantages: dict[str, Advantage]
    group: list[RolloutRecord]
    rollout_advantage: dict[str, float]  # rollout id -> its (outcome - mean) / divisor, credit aside
    note: str


def trained_calls(record: RolloutRecord, spans: list, s: Scoring) -> list[Transition]:
    """The rollout's transitions, as the runtime makes them (runtime.iteration.transitions_of)."""
    return to_transitions(record, spans, credit=s.rule, components=s.components, error_reward=s.error_reward)


def explain(store: Store, record: RolloutRecord, s: Scoring) -> Explained:
    group = store.rollout_page(group_id=record.group_id, phase=record.phase, sort="rollout", descending=False,
                               limit=MAX_SCOPE)[1]
    if record.phase != "train":
        return Explained({}, group, {}, "an eval rollout: scored, never trained on")
    if record.status != "succeeded" or record.reward is None:
        return Explained({}, group, {}, f"not trained on: the rollout is {record.status}")
    scope = group if s.scale != "batch" else store.rollout_page(iteration=record.iteration, phase="train",
                                                                limit=MAX_SCOPE)[1]
    # the runtime's batch: the succeeded rollouts, each scored with its reward, and their trainable calls
    ts: list[Transition] = []
    scored: dict[str, dict[str, float]] = {}
    for r in scope:
        if r.status != "succeeded" or r.reward is None:
            continue
        try:
            ts += trained_calls(r, store.spans(r.rollout_id), s)
        except (CaptureError, ValueError):
            continue  # the runtime would have stopped on it; a sibling's bad record leaves the others readable
        scored.setdefault(r.group_id, {})[r.rollout_id] = float(r.reward)
    if not any(t.rollout_id == record.rollout_id for t in ts):
        return Explained({}, group, {}, "no trainable LLM call (greedy, failed or of a component not trained)")
    b = batch_advantages([t.outcome for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts], s.scale,
                         credit=[t.credit for t in ts], shaping=[t.shaping for t in ts], scored=scored,
                         drop_zero_variance=s.drop_zero_variance)
    if record.group_id in b.dropped:
        why = ("its group has one scored rollout: no baseline" if len(scored.get(record.group_id, {})) < 2 else
               "its group's rewards are all equal and train.drop_zero_variance_groups leaves such groups out")
        return Explained({}, group, {}, f"not trained on: {why}")
    ts, explained = [ts[i] for i in b.kept], b.advantages
    per_rollout = {t.rollout_id: a.rollout_advantage for t, a in zip(ts, explained)}
    mine = {t.span_id: a for t, a in zip(ts, explained) if t.rollout_id == record.rollout_id}
    note = f"{len(mine)} LLM call{'' if len(mine) == 1 else 's'} trained"
    if s.failed_reward is not None and any(r.status == "failed" for r in scope):
        # which failures the runtime penalised depends on where they failed, which the store does not keep
        note += (f"; rollout.failed_reward is set and the group has failed rollouts, which the trainer may have "
                 f"counted at {s.failed_reward:g}: the numbers here leave them out")
    return Explained(mine, group, per_rollout, note)


def sentence(a: Advantage, rule: str) -> str:
    """One call's advantage in words, every number the trainer used."""
    if a.group_mean is None:
        why = ("its group has one scored rollout: no baseline" if a.group_size < 2
               else f"all {a.group_size} rollouts of its group scored {a.outcome:.3g}: no signal")
        return f"Trained with advantage 0, because {why}; intermediate rewards alone never make a signal."
    words = (f"The rollout scored {a.outcome:.3g} against its group's mean {a.group_mean:.3g} (std {a.group_std:.3g},"
             f" {a.group_size} rollouts), so the rollout's advantage is {a.outcome:.3g} minus {a.group_mean:.3g},"
             f" divided by {a.divisor:.3g}: {a.rollout_advantage:.3g}. The credit rule {rule} gives this call"
             f" {a.credit:.3g} of it")
    if a.shaping:
        words += (f", and its intermediate rewards of {a.shaping:.3g} add {a.shaping_term:.3g}"
                  f" (divided by {a.divisor:.3g}, kept within what failing or succeeding outright would change)")
    return words + f". It was trained with advantage {a.value:.3g}."


def view(a: Advantage, rule: str) -> dict[str, Any]:
    return {**asdict(a), "sentence": sentence(a, rule)}


__all__ = ["Explained", "Scoring", "explain", "sentence", "trained_calls", "view"]
