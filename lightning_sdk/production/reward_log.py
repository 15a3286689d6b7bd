"""The rewarded samples of a `lightning serve` store, kept up to date from what arrived since the last read: the
learner's view of the log, so an update costs what its new rewards cost, not what the whole log does.

The numbers are rewarded.call_advantages' (the traffic advantage over every rewarded sample still stored, in the
order its first reward arrived; see rewarded.py), maintained instead of recomputed:

- a refresh reads the feedback rows after its cursor (their rowid: arrival order), the calls stored after its
  cursor (rowid) that belong to a rewarded episode, and the calls retention deleted (retention.PRUNED: a log of
  them); only the samples these touch are read again from the store;
- each component's running baseline is a chain in arrival order; a change re-runs it from the changed sample until
  the baseline it reaches equals the one stored (the rest of the chain is then the same, number for number);
- same-prompt groups keep their members in order; a group's sums (per reply, see traffic_advantage) are recomputed
  only when it changed;
- a sample whose reward is refused (traffic_advantage.admissible) is kept, counted, and filed under no group or
  chain.

Nothing is persisted: the cursors start at 0, so a restart (kill -9 included) re-derives everything from the store
once. Where the cursors cannot be trusted (a reward that sorts before one already read, a span id reused, the
deletion log trimmed past the cursor, the newest feedback row read deleted) the view is rebuilt the same way.

Feedback rows may be deleted (retention prunes them with their calls): one COUNT on the name's index per refresh
tells; the rows of samples whose calls are gone are forgotten (those samples are no longer in the estimate), and a
deleted row of a sample still in it (its reward, or its place in arrival order, would change) rebuilds the view.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_left
from dataclasses import dataclass, field

from lightning_sdk.credit import CreditRule, weights
from lightning_sdk.production.retention import pruned_since
from lightning_sdk.production.traffic_advantage import DEFAULT_ALPHA, admissible, leave_one_out
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
    reply: str | None = None  # its first call's span id: an episode and its first call rewarded alone are one reply
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
        self._chains: dict[str, list[str]] = {}  # component -> its present samples, in order
        self._groups: dict[str, list[str]] = {}  # prompt -> its present samples, in order
        self._sums: dict[str, tuple[dict[str, float], float]] = {}  # prompt -> leave_one_out(group), while unchanged
        self._refused: set[str] = set()  # present samples whose reward is not admissible
        self._feedback = self._spans = self._pruned = 0  # cursors: the last rowid / seq taken in
        self._rows: dict[int, str] = {}  # rowid -> sample of each feedback row taken in and still stored
        self._at_cursor: str | None = None  # the feedback id at the cursor's rowid (SQLite may give a deleted
        # table's last rowid again: another id there means the row read was deleted)
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
        if self._rows and self._db.execute("SELECT feedback_id FROM feedback WHERE rowid=?",
                                           (self._feedback,)).fetchone() != (self._at_cursor,):
            return False  # the newest row read was deleted: a new reward may hold its rowid, below the cursor
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
            if rowid > self._feedback:
                self._feedback, self._at_cursor = rowid, fid
            self._last = (received_at, fid)
            key = rollout_id if kind == "episode_id" else call_id
            self._rows[rowid] = key
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
        return self._forget_deleted_feedback()

    def _forget_deleted_feedback(self) -> bool:
        """Drop the feedback rows read that are no longer stored; False where one was a sample's still in the
        estimate (or one that keeps other rows): then the view is rebuilt."""
        if not self._rows or self._db.execute("SELECT COUNT(*) FROM feedback WHERE name=? AND rowid<=?",
                                              (self.name, self._feedback)).fetchone()[0] == len(self._rows):
            return True
        stored = {r for (r,) in self._db.execute("SELECT rowid FROM feedback WHERE name=? AND rowid<=?",
                                                 (self.name, self._feedback))}
        keys = {self._rows.pop(r) for r in [r for r in self._rows if r not in stored]}
        kept = set(self._rows.values())
        for key in keys:
            s = self.samples.get(key)
            if s is None:
                continue  # a call's sample, dropped when its call was
            if s.calls or key in kept:
                return False
            del self.samples[key]  # an episode with no call left and no reward left
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
        s.calls = [c.span_id for c in calls]
        s.weights = weights(self.rule, calls) if calls else []
        s.prompt = prompt_key(calls[0]) if calls else None
        s.reply = calls[0].span_id if calls else None
        s.component = (calls[0].component or "") if calls else ""

    # ------------------------------------------------------------------------------------------- the estimate

    def _order(self, key: str) -> int:
        return self.samples[key].order

    def _place(self, changed) -> None:
        """File the changed samples under their (prompt, component) and re-run the chains they touch."""
        touched: dict[str, list[int]] = {}  # component -> orders changed in its chain
        for s in changed:
            where = (s.prompt, s.component) if s.prompt is not None and admissible(s.reward) else None
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
            if s.prompt is not None and where is None:
                self._refused.add(s.key)
            else:
                self._refused.discard(s.key)
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
        """traffic_advantage.estimate's number for a present sample: None where it has no baseline (or is refused)."""
        if s.placed is None:
            return None
        group = self._groups[s.prompt]
        sums = self._sums.get(s.prompt)
        if sums is None:
            sums = self._sums[s.prompt] = leave_one_out([(self.samples[k].reply, self.samples[k].reward)
                                                         for k in group])
        value, total = sums
        if len(value) >= 2:
            return s.reward - (total - value[s.reply]) / (len(value) - 1)
        return None if s.before is None else s.reward - s.before

    def refused(self, keys=None) -> int:
        """How many of the samples `keys` (None: all present) have a reward that is refused (not admissible)."""
        return len(self._refused) if keys is None else sum(k in self._refused for k in set(keys))

    def advantages(self, keys) -> dict[tuple[str, str], float]:
        """For each sample of `keys` with a baseline: (sample, call) -> the credit weight of the call in the sample
        times the sample's advantage. A call in several samples has one entry per sample; the others are left out."""
        out: dict[tuple[str, str], float] = {}
        for key in keys:
            s = self.samples.get(key)
            a = None if s is None else self.advantage(s)
            if a is not None:
                for c, w in zip(s.calls, s.weights):
                    out[(key, c)] = w * a
        return out

    def everything(self) -> tuple[dict[tuple[str, str], float], int]:
        """(`advantages` over every present sample; how many present samples have no baseline): the whole log.
        Refused samples are in neither (`refused()` counts them)."""
        none = sum(1 for s in self.samples.values() if s.placed is not None and self.advantage(s) is None)
        return self.advantages(list(self.samples)), none
