"""Live reward by adapter: what the app said of the episodes each adapter served, one sample per episode.

The calls of one episode share its reward, so they are not independent samples: counting each call would weigh a
long episode more than a short one and understate the standard error. The unit is the episode: its value is the
mean of its rewarded calls' rewards, where an episode reward counts whole for each of its calls and a reward by
call or response id for that call alone (how training shares a reward out, the credit rule, does not change what
the app said). A call of no episode rewarded by its id is a unit of its own. An episode is counted under the
adapter that served its calls (the record's policy attribute; the canary routes a whole episode to one adapter).

Read-only (the dashboard reads a serving store with it), and bounded by `since`: only calls started at or after it
and rewards received at or after it (a reward names a call recorded before it arrived) are read, so a canary's
poll reads its own window, not the whole log.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from lightning_sdk.store import connect_read_only
from lightning_sdk.tracing.records import GATEWAY, POLICY

_CALLS = ("SELECT s.span_id, s.rollout_id, json_extract(s.attributes, ?) AS policy, f.kind, f.value "
          "FROM feedback f JOIN spans s ON {on} AND s.source=? AND s.start_ns>=? "
          "WHERE f.name=? AND f.received_at>=? AND {kind}")
UNITS = " UNION ALL ".join([_CALLS.format(on="s.rollout_id=f.rollout_id", kind="f.kind='episode_id'"),
                            _CALLS.format(on="s.span_id=f.call_id", kind="f.kind!='episode_id'")])


@dataclass(frozen=True)
class Live:
    """One adapter's live reward: the mean over its rewarded episodes, its standard error (None under 2)."""

    adapter: str
    mean: float
    stderr: float | None
    episodes: int


def by_adapter(path: str | Path, name: str = "reward", *, since: float = 0.0) -> dict[str, list[float]]:
    """Each adapter's rewarded episodes' values (feedback named `name`), for calls started at or after `since`
    (unix seconds); the base model's calls under its served name, a call with none under ""."""
    db = connect_read_only(path)
    try:
        args = (f'$."{POLICY}"', GATEWAY, int(since * 1e9), name, since)
        rows = db.execute(UNITS, args + args).fetchall()
    finally:
        db.close()
    # (adapter, unit) -> call -> its reward: the episode's rewards plus its own
    units: dict[tuple[str, str], dict[str, float]] = {}
    for span_id, rollout_id, policy, _kind, value in rows:
        calls = units.setdefault((policy or "", rollout_id or f"call:{span_id}"), {})
        calls[span_id] = calls.get(span_id, 0.0) + value
    out: dict[str, list[float]] = {}
    for (policy, _unit), calls in sorted(units.items()):
        value = statistics.fmean(calls.values())
        if math.isfinite(value):
            out.setdefault(policy, []).append(value)
    return out


def summarize(adapter: str, values: list[float]) -> Live:
    """Mean and standard error (sample std / sqrt(n)) over the episodes."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else None
    return Live(adapter, statistics.fmean(values), se, len(values))
