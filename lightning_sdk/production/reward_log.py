"""The rewarded samples of a `lightning serve` store, kept up to date from what arrived since the last read: the
learner's view of the log, so an update costs what its new rewards cost, not what the whole log does.

The numbers are rewarded.call_advantages' (the traffic advantage over every rewarded sample still stored, in the
order its first reward arrived; see rewarded.py), maintained instead of recomputed:

- a refresh reads the feedback rows after its cursor (their rowid: arrival order, rows are never deleted), the
  calls stored after its cursor (rowid) that belong to a rewarded episode, and the calls retention deleted
  (retention.PRUNED: a log of them); only the samples these touch are read again from the store;
- each component's running baseline is a chain in arrival order; a change re-runs it from the changed sample until
  the baseline it reaches equals the one stored (the rest of the chain is then the same, number for number);
- same-prompt groups keep their members in order; a group's sum is recomputed only when it changed.

Nothing is persisted: the cursors start at 0, so a restart (kill -9 included) re-derives everything from the store
once. Where the cursors cannot be trusted (a reward that sorts before one already read, a span id reused, the
deletion log trimmed past the cursor) the view is rebuilt the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
from bisect import bisect_left
from dataclasses import dataclass, field

from lightning_sdk.credit import CreditRule, weights
from lightning_sdk.production.retention import pruned_since
from lightning_sdk.production.traffic_advantage import DEFAULT_ALPHA
from lightning_sdk.store import Store, connect_read_only
from lightning_sdk.tracing.records import GATEWAY, PROMPT_IDS, SpanRecord


def prompt_key(call: SpanRecord) -> str:
    """A sample's prompt: the exact prompt token ids of its first call."""
    return hashlib.sha256(json.dumps(call.attributes.get(PROMPT_IDS)).encode()).hexdigest()


@dataclass(slots=True)
class Sample:
    """One rewarded episode, or one call rewarded by its id."""

    key: str  # the episode's rollout id, or the call's span id
    episode: bool
    rollout_id: str  # "" for a call of no episode
    order: int  # its place in arrival order (its first reward)
    reward: float = 0.0  # its rewards of the name, summed in arrival order
    calls: list[str] = field(default_factory=list)  # its calls' span ids, in order; empty: not in the estimate
    weights: list[float] = field(default_factory=list)  # the credit rule's, over `calls`
    prompt: str | None = None
    component: str = ""
    placed: tuple[str, str] | None = None  # (prompt, component) it is filed under, None when absent
    before: float | None = None  # its component's running baseline before it
    after: float | None = None  # ... and after it


class RewardLog:
    """Rewards named `name` of the store `store` and the calls they score; `refresh()` takes in what arrived."""

    def __init__(self, store: Store, rule: CreditRule, name: str = "reward", alpha: float = DEFAULT_ALPHA):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha = {alpha!r}: expected 0 < alpha <= 1")
        self.store, self.rule, self.name, self.alpha = store, rule, name, alpha
        self.spans_read = 0  # spans decoded from the store since start: what a refresh cost
        self.rebuilds = 0
        self._db = connect_read_only(store.path)
        self._reset()

    def close(self) -> None:
        self._db.close()

    def _reset(self) -> None:
        self.samples: dict[str, Sample] = {}
        self._containing: dict[str, list[str]] = {}  # call span id -> the samples it is in
        self._chains: dict[str, list[str]] = {}  # component -> its present samples, in order
        self._groups: dict[str, list[str]] = {}  # prompt -> its present samples, in order
        self._sums: dict[str, float] = {}  # prompt -> sum of its rewards (as sum() adds them), while unchanged
        self._bad: set[str] = set()  # present samples whose reward is not finite
        self._feedback = self._spans = self._pruned = 0  # cursors: the last rowid / seq taken in
        self._next = 0  # the order the next new sample gets
        self._last: tuple[float, str] | None = None  # the (received_at, feedback_id) read last

    # ----------------------------------------------------------------------------------------------- reading

    def refresh(self) -> None:
        """Take in the rewards, calls and deletions since the last refresh (the first: everything)."""
        if not self._take_in(fresh=not self.samples):
            self.rebuilds += 1
            self._reset()
            self._take_in(fresh=True)

    def _take_in(self, fresh: bool) -> bool:
        """False where the cursors cannot be trusted (rebuild); `fresh`: nothing read yet, nothing to check."""
        dirty: set[str] = set()
        gone, trimmed = pruned_since(self._db, self._pruned)
        if not fresh and trimmed:
            return False  # deletions trimmed from the log before they were read
        if not fresh and gone and max(g[1] for g in gone) >= self._spans:
            return False  # the newest span was deleted: its rowid may be given again
        for seq, _rowid, span_id, rollout_id in gone:
            self._pruned = seq
            dirty.update(k for k in (span_id, rollout_id) if k in self.samples)
        newest = self._db.execute("SELECT COALESCE(MAX(rowid), 0) FROM spans").fetchone()[0]
        if newest < self._spans:
            return False
        if not fresh:
            for (rollout_id,) in self._db.execute("SELECT DISTINCT rollout_id FROM spans WHERE rowid>? AND rowid<=? "
                                                  "AND source=?", (self._spans, newest, GATEWAY)):
                s = self.samples.get(rollout_id)
                if s is not None and s.episode:
                    dirty.add(rollout_id)
        self._spans = newest
        rows = self._db.execute("SELECT rowid, kind, rollout_id, call_id, value, received_at, feedback_id "
                                "FROM feedback WHERE name=? AND rowid>? ORDER BY received_at, feedback_id",
                                (self.name, self._feedback)).fetchall()
        if not fresh and rows and self._last is not None and (rows[0][5], rows[0][6]) <= self._last:
            return False  # arrived out of order: a sample's place may change
        changed: dict[str, Sample] = {}
        for rowid, kind, rollout_id, call_id, value, received_at, fid in rows:
            self._feedback = max(self._feedback, rowid)
            self._last = (received_at, fid)
            key = rollout_id if kind == "episode_id" else call_id
            s = self.samples.get(key)
            if s is None:
                s = self.samples[key] = Sample(key, kind == "episode_id", rollout_id or "", self._next)
                self._next += 1
                dirty.add(key)
            s.reward = s.reward + value
            changed[key] = s
        for key in dirty:
            self._load(self.samples[key])
            changed[key] = self.samples[key]
        self._place(changed.values())
        for s in changed.values():
            if not s.episode and not s.calls:  # its call is gone for good (a call's id is never given again)
                del self.samples[s.key]
        return True

    def _load(self, s: Sample) -> None:
        """A sample's calls as the store holds them now."""
        if s.episode:
            spans = self.store.spans(s.rollout_id)
        else:
            one = self.store.span(s.key)
            spans = [one] if one is not None and one.rollout_id == s.rollout_id else []
        self.spans_read += len(spans)
        calls = [c for c in spans if c.source == GATEWAY]
        for c in s.calls:
            self._containing[c].remove(s.key)
            if not self._containing[c]:
                del self._containing[c]
        s.calls = [c.span_id for c in calls]
        for c in s.calls:
            self._containing.setdefault(c, []).append(s.key)
        s.weights = weights(self.rule, calls) if calls else []
        s.prompt = prompt_key(calls[0]) if calls else None
        s.component = (calls[0].component or "") if calls else ""

    # ------------------------------------------------------------------------------------------- the estimate

    def _order(self, key: str) -> int:
        return self.samples[key].order

    def _place(self, changed) -> None:
        """File the changed samples under their (prompt, component) and re-run the chains they touch."""
        touched: dict[str, list[int]] = {}  # component -> orders changed in its chain
        for s in changed:
            where = (s.prompt, s.component) if s.prompt is not None else None
            if s.placed is not None and s.placed != where:
                prompt, comp = s.placed
                chain, group = self._chains[comp], self._groups[prompt]
                del chain[bisect_left(chain, s.order, key=self._order)]
                del group[bisect_left(group, s.order, key=self._order)]
                if not group:
                    del self._groups[prompt]
                self._sums.pop(prompt, None)
                touched.setdefault(comp, []).append(s.order)
                s.placed = None
            if where is not None:
                if s.placed is None:
                    chain = self._chains.setdefault(s.component, [])
                    group = self._groups.setdefault(s.prompt, [])
                    chain.insert(bisect_left(chain, s.order, key=self._order), s.key)
                    group.insert(bisect_left(group, s.order, key=self._order), s.key)
                    s.placed = where
                self._sums.pop(s.prompt, None)
                touched.setdefault(s.component, []).append(s.order)
            if where is not None and not math.isfinite(s.reward):
                self._bad.add(s.key)
            else:
                self._bad.discard(s.key)
        for comp, orders in touched.items():
            self._rechain(comp, min(orders), max(orders))

    def _rechain(self, comp: str, first: int, last: int) -> None:
        """Re-run the running baseline of `comp` from the sample of order `first`; past `last`, stop where the
        baseline reached equals the stored one (from there on nothing differs)."""
        chain = self._chains.get(comp, [])
        p = bisect_left(chain, first, key=self._order)
        b = self.samples[chain[p - 1]].after if p else None
        for key in chain[p:]:
            s = self.samples[key]
            if s.order > last and (s.before is None) == (b is None) and (b is None or s.before == b):
                return
            s.before = b
            b = s.reward if b is None else b + self.alpha * (s.reward - b)
            s.after = b
        if not chain:
            self._chains.pop(comp, None)

    def advantage(self, s: Sample) -> float | None:
        """traffic_advantage.estimate's number for a present sample: None where it has no baseline."""
        group = self._groups[s.prompt]
        if len(group) >= 2:
            total = self._sums.get(s.prompt)
            if total is None:
                total = self._sums[s.prompt] = sum(self.samples[k].reward for k in group)
            return s.reward - (total - s.reward) / (len(group) - 1)
        return None if s.before is None else s.reward - s.before

    def _check(self) -> None:
        if self._bad:
            first = min(self._bad, key=self._order)
            raise ValueError(f"episode {first}: reward is not a finite number")

    def advantages(self, call_ids) -> dict[str, float]:
        """Each of `call_ids` that some sample with a baseline holds: the sum over those samples (in arrival order)
        of the credit weight times the sample's advantage; the others are left out."""
        self._check()
        out: dict[str, float] = {}
        for c in call_ids:
            for key in sorted(self._containing.get(c, ()), key=self._order):
                s = self.samples[key]
                a = self.advantage(s)
                if a is not None:
                    out[c] = out.get(c, 0.0) + s.weights[s.calls.index(c)] * a
        return out

    def everything(self) -> tuple[dict[str, float], int]:
        """(every call's advantage, as `advantages`; how many present samples have no baseline): the whole log."""
        self._check()
        out: dict[str, float] = {}
        none = 0
        for s in self.samples.values():
            if s.prompt is None:
                continue
            a = self.advantage(s)
            if a is None:
                none += 1
                continue
            for c, w in zip(s.calls, s.weights):
                out[c] = out.get(c, 0.0) + w * a
        return out, none
