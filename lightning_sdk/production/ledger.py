"""Feedback that arrives late and by reference, kept in the store's SQLite file beside the calls it scores.

A reward names one of: a response id (the `id` of the reply the app got), a call id (the `x-lightning-call-id`
header of that reply) or an episode id (the trace id its calls carried). Each is checked against the recorded
calls before anything is written, and each fault gets one answer naming the field:

- 422 `value` / `timestamp` / `name` / `id`: not a number within +-MAX_ABS_REWARD (the bound a run puts on every
  reward), not unix seconds, not a non-empty name, not exactly one id
- 422 `feedback_id`: an id of the default form (`KIND:ID:NAME`) that is not this reward's own default id
- 404 `<kind>_id`: no recorded call has that id
- 410 `<kind>_id`: its newest call is older than the retention window
- 409 `<kind>_id`: the call or episode already holds `max_per_target` rewards (MAX_FEEDBACK_PER_TARGET)
- 409 `feedback_id`: that app-given feedback id was recorded with another reward (the same one again is answered
  200 with `duplicate: true` and counted once, so an app may retry a request whose reply it lost)

Each accepted reward is one committed row (primary key: its feedback id), written before the reply: a reply of 200
means it survives kill -9, and a retry is never counted twice. With no feedback id given, the id is made from the
target, the name and the value: the default id is a retry key bound to its target and its reward, never a claim,
so no key holder can take it first and have the app's own reward refused; ids of that form are reserved for the
ledger (an app-given id of the form is taken only where it equals this reward's own). The cap per call or
episode bounds how much any key holder can add to one reply. Retention deletes a reward's row once every call it
scores is deleted (production/retention.py).
"""

from __future__ import annotations

import math
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sdk.config import MAX_ABS_REWARD
from lightning_sdk.credit import CreditRule, weights
from lightning_sdk.production.episodes import episode_id
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import GATEWAY

KINDS = ("response_id", "call_id", "episode_id")
DEFAULT_RETENTION_S = 30 * 86400.0
# Rewards one call or one episode may hold (all names together): enough for every metric an app keeps of a reply,
# and a bound on what one key holder can add to a reply that is not theirs.
MAX_FEEDBACK_PER_TARGET = 16

SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    feedback_id TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,      -- 'response_id' | 'call_id' | 'episode_id'
    target      TEXT NOT NULL,      -- the id as the app gave it
    rollout_id  TEXT,               -- the episode, where the target is one
    call_id     TEXT,               -- the call, where the target is one call
    name        TEXT NOT NULL,
    value       REAL NOT NULL,
    at          REAL NOT NULL,      -- when the app says the outcome happened (unix seconds)
    received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_by_rollout ON feedback (rollout_id);
CREATE INDEX IF NOT EXISTS feedback_by_call ON feedback (call_id);  -- the cap per call; retention's pruning
CREATE INDEX IF NOT EXISTS feedback_by_name ON feedback (name);
CREATE INDEX IF NOT EXISTS feedback_by_arrival ON feedback (name, received_at);  -- a canary's window
-- a reward by response id finds its call through this, not by reading every call's attributes (the WHERE and the
-- expression are the lookup's, as SQLite needs them to use it)
CREATE INDEX IF NOT EXISTS spans_by_response_id ON spans (json_extract(attributes, '$."gen_ai.response.id"'))
    WHERE source = 'gateway';
CREATE TABLE IF NOT EXISTS learn_consumed (
    feedback_id TEXT PRIMARY KEY,
    version     INTEGER,              -- the update that trained on it; NULL: read, but nothing in it could train
    reason      TEXT                  -- NULL: read by an update; else why it was set aside (quarantined)
);
"""

BY_RESPONSE_ID = (f"SELECT span_id, rollout_id, end_ns FROM spans WHERE source = '{GATEWAY}' AND "
                  "json_extract(attributes, '$.\"gen_ai.response.id\"') = ? LIMIT 1")  # spans_by_response_id

# A reward's place in arrival order is its rowid: SQLite gives each insert one above the largest, and retention never
# deletes the row with the largest (production/retention.py), so no rowid is given twice: "every reward up to seq s
# is consumed" is one number and the unread ones are a range after it.
UNREAD = ("FROM feedback f WHERE f.name=? AND f.rowid>? AND NOT EXISTS "
          "(SELECT 1 FROM learn_consumed c WHERE c.feedback_id=f.feedback_id)")


class FeedbackError(Exception):
    """A reward refused: `status` (HTTP), `field` (the one it names) and one line saying why."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


@dataclass(frozen=True)
class Accepted:
    feedback_id: str
    duplicate: bool  # the same reward was already recorded: counted once
    calls: int  # the calls it scores


class FeedbackLedger:
    """Feedback in the store at `path` (its own connection: the gateway's writer keeps the store's)."""

    def __init__(self, path: str | Path, *, retention_s: float = DEFAULT_RETENTION_S,
                 max_per_target: int = MAX_FEEDBACK_PER_TARGET):
        if not (retention_s > 0 and math.isfinite(retention_s)):
            raise ValueError(f"retention_s = {retention_s!r}: expected a positive number of seconds")
        if isinstance(max_per_target, bool) or not isinstance(max_per_target, int) or max_per_target < 1:
            raise ValueError(f"max_per_target = {max_per_target!r}: expected a whole number >= 1")
        Store(path).close()  # the store's tables exist before feedback is checked against them
        self.retention_s, self.max_per_target = retention_s, max_per_target
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        if "reason" not in {r["name"] for r in self._db.execute("PRAGMA table_info(learn_consumed)")}:
            self._db.execute("ALTER TABLE learn_consumed ADD COLUMN reason TEXT")  # a store from before quarantine

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def give(self, body: Any, *, now: float | None = None) -> Accepted:
        """Record one reward from a request body (see the module docstring); FeedbackError if refused."""
        now = time.time() if now is None else now
        if not isinstance(body, dict):
            raise FeedbackError(422, "body", "expected a JSON object")
        named = [k for k in KINDS if body.get(k) is not None]
        if len(named) != 1:
            raise FeedbackError(422, "id", f"expected exactly one of {', '.join(KINDS)}; got "
                                           f"{', '.join(named) or 'none'}")
        kind = named[0]
        target = body[kind]
        if not isinstance(target, str) or not target or len(target) > 200 or not target.isprintable():
            raise FeedbackError(422, kind, "expected a non-empty printable string of at most 200 characters")
        value = body.get("value")
        # Compared, never converted: an integer of any size is refused, and NaN fails both comparisons.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -MAX_ABS_REWARD <= value <= MAX_ABS_REWARD:
            raise FeedbackError(422, "value", f"expected a finite number from {-MAX_ABS_REWARD:g} to "
                                              f"{MAX_ABS_REWARD:g} (the bound a run puts on every reward); got "
                                              f"{_shown(value)}")
        name = body.get("name", "reward")
        if not isinstance(name, str) or not name or len(name) > 200 or not name.isprintable():
            raise FeedbackError(422, "name", "expected a non-empty printable string of at most 200 characters")
        at = body.get("timestamp", now)
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not -sys.float_info.max <= at <= \
                sys.float_info.max:  # compared, never converted, as the value
            raise FeedbackError(422, "timestamp", "expected unix seconds (a finite number)")
        given = body.get("feedback_id")
        if given is not None and (not isinstance(given, str) or not given or len(given) > 200 or
                                  not given.isprintable()):
            raise FeedbackError(422, "feedback_id", "expected a non-empty printable string of at most 200 characters")
        value = float(value)
        default = f"{kind}:{target}:{name}"
        valued = f"{default}:{value!r}"  # the id a default slot holding another value gives (see _slot)
        if given is not None and given not in (default, valued) and given.partition(":")[0] in KINDS:
            raise FeedbackError(422, "feedback_id", f"{given[:80]!r} has the form of a default id (KIND:ID:NAME), "
                                                    f"which only its own target and name may use; give another "
                                                    f"feedback_id, or none")
        reward = (kind, target, name, value)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # the call looked up is the call the row scores: no pass between
            try:
                rollout_id, call_id, calls, newest_ns = self._resolve(kind, target)
                if calls == 0:
                    raise FeedbackError(404, kind, f"no recorded call has {kind} {target!r}")
                if newest_ns / 1e9 < now - self.retention_s:
                    raise FeedbackError(410, kind, f"its calls are older than the retention window "
                                                   f"({self.retention_s:g} s): not kept for training")
                fid, stored = self._slot(given, default, reward)
                held = 0
                if stored is None:
                    held = self._held(kind, rollout_id, call_id)
                    if held < self.max_per_target:
                        self._db.execute("INSERT INTO feedback VALUES (?,?,?,?,?,?,?,?,?)",
                                         (fid, kind, target, rollout_id, call_id, name, value, float(at), now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        if stored is None and held >= self.max_per_target:
            what = "episode" if kind == "episode_id" else "call"
            raise FeedbackError(409, kind, f"the {what} of {kind} {target!r} already holds {held} rewards, the most "
                                           f"one {what} takes (MAX_FEEDBACK_PER_TARGET = {self.max_per_target}); "
                                           f"nothing was recorded")
        if stored is None:
            return Accepted(fid, False, calls)
        if (stored["kind"], stored["target"], stored["name"], stored["value"]) != reward:
            raise FeedbackError(409, "feedback_id", f"feedback {fid!r} was recorded with another reward "
                                                    f"({stored['name']} = {stored['value']:g} for "
                                                    f"{stored['kind']} {stored['target']!r}); the first one stands")
        return Accepted(fid, True, calls)

    def _slot(self, given: str | None, default: str, reward: tuple) -> tuple[str, sqlite3.Row | None]:
        """(the feedback id this reward is recorded under, the row already there or None). An app-given id is the
        app's; a default id is the target and name's, with the value appended where that slot holds another value
        (a stored row from before ids held the value keeps its place)."""
        if given is not None and given not in (default, f"{default}:{reward[3]!r}"):
            return given, self._db.execute("SELECT * FROM feedback WHERE feedback_id=?", (given,)).fetchone()
        stored = self._db.execute("SELECT * FROM feedback WHERE feedback_id=?", (default,)).fetchone()
        if stored is None or (stored["kind"], stored["target"], stored["name"], stored["value"]) == reward:
            return default, stored
        fid = f"{default}:{reward[3]!r}"
        return fid, self._db.execute("SELECT * FROM feedback WHERE feedback_id=?", (fid,)).fetchone()

    def _held(self, kind: str, rollout_id: str | None, call_id: str | None) -> int:
        """How many rewards (of any name) the target's call, or its episode, holds."""
        if kind == "episode_id":
            return self._db.execute("SELECT COUNT(*) FROM feedback WHERE rollout_id=? AND kind='episode_id'",
                                    (rollout_id,)).fetchone()[0]
        return self._db.execute("SELECT COUNT(*) FROM feedback WHERE call_id=? AND kind!='episode_id'",
                                (call_id,)).fetchone()[0]

    def _resolve(self, kind: str, target: str) -> tuple[str | None, str | None, int, int]:
        """(episode, call, how many calls it scores, the newest call's end in ns)."""
        if kind == "episode_id":
            rid = episode_id(target)
            row = self._db.execute("SELECT COUNT(*) AS n, MAX(end_ns) AS newest FROM spans WHERE rollout_id=? AND "
                                   "source=?", (rid, GATEWAY)).fetchone()
            return rid, None, row["n"], row["newest"] or 0
        if kind == "call_id":
            row = self._db.execute("SELECT span_id, rollout_id, end_ns FROM spans WHERE span_id=? AND source=?",
                                   (target, GATEWAY)).fetchone()
        else:
            row = self._db.execute(BY_RESPONSE_ID, (target,)).fetchone()
        if row is None:
            return None, None, 0, 0
        return row["rollout_id"] or None, row["span_id"], 1, row["end_ns"]

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) AS n FROM feedback").fetchone()["n"]

    def rows(self, name: str = "reward") -> list[sqlite3.Row]:
        """The rewards named `name`, in the order they arrived."""
        with self._lock:
            return self._db.execute("SELECT * FROM feedback WHERE name=? ORDER BY received_at, feedback_id",
                                    (name,)).fetchall()

    def unread(self, name: str, after: int = 0) -> list[sqlite3.Row]:
        """The rewards named `name` no update has consumed, after arrival seq `after`, in arrival order (with
        their `seq`)."""
        with self._lock:
            return self._db.execute(f"SELECT f.rowid AS seq, f.* {UNREAD} ORDER BY f.rowid", (name, after)).fetchall()

    def unread_count(self, name: str, after: int = 0) -> int:
        """How many rewards `unread` would return: one indexed range count, for a poll."""
        with self._lock:
            return self._db.execute(f"SELECT COUNT(*) AS n {UNREAD}", (name, after)).fetchone()["n"]

    def consumed_through(self, name: str) -> int:
        """The largest seq at or below which every reward named `name` is consumed (a scan: once, at start)."""
        with self._lock:
            row = self._db.execute(f"SELECT MIN(f.rowid) AS first {UNREAD}", (name, 0)).fetchone()
            if row["first"] is not None:
                return row["first"] - 1
            return self._db.execute("SELECT COALESCE(MAX(rowid), 0) AS n FROM feedback WHERE name=?",
                                    (name,)).fetchone()["n"]

    def call_rewards(self, store: Store, rule: CreditRule, name: str = "reward") -> dict[str, float]:
        """Each rewarded call's reward for `name`: its own feedback (by call or response id), plus its share of
        its episode's (`weight_k * R`, the weights of the credit rule over the episode's calls in order)."""
        out: dict[str, float] = {}
        for r in self.rows(name):
            if r["kind"] != "episode_id":
                out[r["call_id"]] = out.get(r["call_id"], 0.0) + r["value"]
                continue
            calls = [s for s in store.spans(r["rollout_id"]) if s.source == GATEWAY]
            for call, w in zip(calls, weights(rule, calls)):
                out[call.span_id] = out.get(call.span_id, 0.0) + w * r["value"]
        return out


def _shown(value: Any) -> str:
    """A refused value, briefly (an integer is never turned to text whole: Python refuses long ones)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 50:
        return "an integer of more than 50 digits"
    return str(value)[:50]
