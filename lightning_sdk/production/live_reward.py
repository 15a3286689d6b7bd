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

Rewards are app input: a value near the float limit (1.7e308) must not stop a canary or the dashboard, so means and
variances are taken in units of the largest magnitude (`moments`): statistics.fmean and variance raise OverflowError
on such values. An episode whose rewards add up beyond float (inf) is not a number to average: left out, counted.
"""

from __future__ import annotations

import math
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lightning_sdk.production.retention import pruned_since
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


def magnitude(*sides: Sequence[float]) -> float:
    """The unit `moments` takes values in: the largest finite magnitude, at least 1 (so rewards in [-1, 1] are
    taken as they are)."""
    return max([1.0, *(abs(v) for side in sides for v in side if math.isfinite(v))])


def moments(values: Sequence[float], scale: float = 1.0) -> tuple[float, float]:
    """Mean and sample variance (0.0 under 2 values) of finite `values`, each divided by `scale` first: with `scale`
    their largest magnitude (`magnitude`), every sum stays within float, however large the values."""
    xs = [v / scale for v in values]
    return statistics.fmean(xs), statistics.variance(xs) if len(xs) >= 2 else 0.0


def mean_of(values: Sequence[float]) -> float:
    """The mean of finite `values`, in their own unit (`moments`): finite, however large they are."""
    scale = magnitude(values)
    return moments(values, scale)[0] * scale


def by_adapter(path: str | Path, name: str = "reward", *, since: float = 0.0) -> dict[str, list[float]]:
    """Each adapter's rewarded episodes' values (feedback named `name`), for calls started at or after `since`
    (unix seconds); the base model's calls under its served name, a call with none under "". An episode whose
    rewards add up beyond float is there as inf (or nan): `summarize` and canary.judge leave it out, counted."""
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
        values = list(calls.values())
        value = mean_of(values) if all(math.isfinite(v) for v in values) else sum(values)
        out.setdefault(policy, []).append(value)
    return out


def summarize(adapter: str, values: Sequence[float]) -> Live:
    """Mean and standard error (sample std / sqrt(n)) over the episodes with a finite value (the others left out)."""
    kept = [v for v in values if math.isfinite(v)]
    scale = magnitude(kept)
    average, variance = moments(kept, scale) if kept else (math.nan, 0.0)
    se = math.sqrt(variance / len(kept)) * scale if len(kept) >= 2 else None
    return Live(adapter, average * scale, se, len(kept))


class LiveLog:
    """`by_adapter` over the whole log (since = 0) kept up to date for a reader that polls (the dashboard): each
    `summaries()` takes in the rewards and calls stored since the last and the calls retention deleted (its log,
    retention.PRUNED), and keeps each adapter's sum and sum of squares over its episodes, so a poll costs what arrived,
    not the whole store. The mean and standard error equal `summarize(by_adapter(...))` up to rounding (sums kept
    as they change rather than added up again). Nothing kept on disk: a new reader reads the log once."""

    def __init__(self, path: str | Path, name: str = "reward"):
        self.path, self.name = Path(path), name
        self.rebuilds = 0
        self._lock = threading.Lock()  # one poll at a time takes in what arrived
        self._reset()

    def _reset(self) -> None:
        self._calls: dict[str, tuple[str, str, float]] = {}  # call -> (adapter, unit, its reward)
        self._units: dict[tuple[str, str], list[float]] = {}  # (adapter, unit) -> [sum of its calls', calls]
        self._sums: dict[str, list[float]] = {}  # adapter -> [episodes, sum, sum of squares] of unit values
        self._episodes: dict[str, float] = {}  # rewarded episode -> its rewards' sum (a call joining it later)
        self._feedback = self._spans = self._pruned = 0

    def _unit_value(self, unit: tuple[str, str]) -> float | None:
        got = self._units.get(unit)
        return got[0] / got[1] if got and got[1] else None

    def _add(self, span_id: str, policy: str | None, rollout_id: str | None, value: float) -> None:
        known = self._calls.get(span_id)
        adapter, unit, old = known if known else (policy or "", rollout_id or f"call:{span_id}", 0.0)
        self._change((adapter, unit), old, old + value, new_call=known is None)
        self._calls[span_id] = (adapter, unit, old + value)

    def _change(self, unit: tuple[str, str], old: float, new: float | None, new_call: bool) -> None:
        """One call of `unit` changed its reward from `old` to `new` (None: it left); the adapter's sums follow."""
        before = self._unit_value(unit)
        u = self._units.setdefault(unit, [0.0, 0])
        if new is None:
            u[0] -= old
            u[1] -= 1
        else:
            u[0] += new - (0.0 if new_call else old)
            u[1] += 1 if new_call else 0
        after = self._unit_value(unit)
        if not u[1]:
            del self._units[unit]
        s = self._sums.setdefault(unit[0], [0, 0.0, 0.0])
        for v, sign in ((before, -1), (after, 1)):
            if v is not None and math.isfinite(v):
                s[0] += sign
                s[1] += sign * v
                s[2] += sign * v * v

    def _take_in(self, db, fresh: bool) -> bool:
        gone, trimmed = pruned_since(db, self._pruned)
        if not fresh and (trimmed or (gone and max(g[1] for g in gone) >= self._spans)):
            return False
        for seq, _rowid, span_id, _rollout in gone:
            self._pruned = seq
            if span_id in self._calls:
                adapter, unit, value = self._calls.pop(span_id)
                self._change((adapter, unit), value, None, False)
        newest = db.execute("SELECT COALESCE(MAX(rowid), 0) FROM spans").fetchone()[0]
        if newest < self._spans:
            return False
        policy = f'$."{POLICY}"'
        if not fresh and self._episodes:
            for span_id, rollout_id, p in db.execute(
                    "SELECT span_id, rollout_id, json_extract(attributes, ?) FROM spans WHERE rowid>? AND rowid<=? AND "
                    "source=?", (policy, self._spans, newest, GATEWAY)):
                if rollout_id in self._episodes and span_id not in self._calls:
                    self._add(span_id, p, rollout_id, self._episodes[rollout_id])
        self._spans = newest
        for rowid, kind, rollout_id, call_id, value in db.execute(
                "SELECT rowid, kind, rollout_id, call_id, value FROM feedback WHERE name=? AND rowid>? ORDER BY rowid",
                (self.name, self._feedback)).fetchall():
            self._feedback = rowid
            if kind == "episode_id":
                self._episodes[rollout_id] = self._episodes.get(rollout_id, 0.0) + value
                calls = db.execute("SELECT span_id, json_extract(attributes, ?) FROM spans WHERE rollout_id=? AND "
                                   "source=? AND rowid<=?", (policy, rollout_id, GATEWAY, newest)).fetchall()
            else:
                calls = db.execute("SELECT span_id, json_extract(attributes, ?) FROM spans WHERE span_id=? AND "
                                   "source=? AND rowid<=?", (policy, call_id, GATEWAY, newest)).fetchall()
            for span_id, p in calls:
                self._add(span_id, p, rollout_id, value)
        return True

    def summaries(self) -> dict[str, Live]:
        """Each adapter's live reward now (adapters with no finite episode left out)."""
        with self._lock:
            db = connect_read_only(self.path)
            try:
                if not self._take_in(db, fresh=not self._calls and not self._feedback):
                    self.rebuilds += 1
                    self._reset()
                    self._take_in(db, fresh=True)
            finally:
                db.close()
            sums = sorted((a, tuple(s)) for a, s in self._sums.items())
            out = {}
            for adapter, (n, total, squares) in sums:
                if n <= 0:
                    continue
                if not (math.isfinite(total) and math.isfinite(squares)):  # huge rewards: add the episodes up again
                    values = [v for unit in self._units if unit[0] == adapter
                              if (v := self._unit_value(unit)) is not None and math.isfinite(v)]
                    out[adapter] = summarize(adapter, values)
                    continue
                mean = total / n
                se = math.sqrt(max(0.0, (squares - n * mean * mean) / (n - 1)) / n) if n >= 2 else None
                out[adapter] = Live(adapter, mean, se, int(n))
        return out
