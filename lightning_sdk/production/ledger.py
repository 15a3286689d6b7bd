"""Feedback that arrives late and by reference, kept in the store's SQLite file beside the calls it scores.

A reward names one of: a response id (the `id` of the reply the app got), a call id (the `x-lightning-call-id`
header of that reply) or an episode id (the trace id its calls carried). Each is checked against the recorded
calls before anything is written, and each fault gets one answer naming the field:

- 422 `value` / `timestamp` / `name` / `id`: not a finite number, not a non-empty name, not exactly one id
- 404 `<kind>_id`: no recorded call has that id
- 410 `<kind>_id`: its newest call is older than the retention window
- 409 `feedback_id`: that feedback id was recorded with another reward (the same one again is answered 200 with
  `duplicate: true` and counted once, so an app may retry a request whose reply it lost)

Each accepted reward is one committed row (primary key: its feedback id, given by the app or made from the target
and name), written before the reply: a reply of 200 means it survives kill -9, and a retry is never counted twice.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sdk.credit import CreditRule, weights
from lightning_sdk.production.episodes import episode_id
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import GATEWAY

KINDS = ("response_id", "call_id", "episode_id")
DEFAULT_RETENTION_S = 30 * 86400.0

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

# A reward's place in arrival order is its rowid: SQLite gives each insert one above the largest (feedback rows are
# never deleted), so "every reward up to seq s is consumed" is one number and the unread ones are a range after it.
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

    def __init__(self, path: str | Path, *, retention_s: float = DEFAULT_RETENTION_S):
        if not (retention_s > 0 and math.isfinite(retention_s)):
            raise ValueError(f"retention_s = {retention_s!r}: expected a positive number of seconds")
        Store(path).close()  # the store's tables exist before feedback is checked against them
        self.retention_s = retention_s
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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise FeedbackError(422, "value", f"expected a finite number; got {str(value)[:50]}")
        name = body.get("name", "reward")
        if not isinstance(name, str) or not name or len(name) > 200 or not name.isprintable():
            raise FeedbackError(422, "name", "expected a non-empty printable string of at most 200 characters")
        at = body.get("timestamp", now)
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise FeedbackError(422, "timestamp", "expected unix seconds (a finite number)")
        fid = body.get("feedback_id")
        if fid is not None and (not isinstance(fid, str) or not fid or len(fid) > 200 or not fid.isprintable()):
            raise FeedbackError(422, "feedback_id", "expected a non-empty printable string of at most 200 characters")
        fid = fid or f"{kind}:{target}:{name}"
        with self._lock:
            rollout_id, call_id, calls, newest_ns = self._resolve(kind, target)
            if calls == 0:
                raise FeedbackError(404, kind, f"no recorded call has {kind} {target!r}")
            if newest_ns / 1e9 < now - self.retention_s:
                raise FeedbackError(410, kind, f"its calls are older than the retention window "
                                               f"({self.retention_s:g} s): not kept for training")
            row = (fid, kind, target, rollout_id, call_id, name, float(value), float(at), now)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                stored = self._db.execute("SELECT * FROM feedback WHERE feedback_id=?", (fid,)).fetchone()
                if stored is None:
                    self._db.execute("INSERT INTO feedback VALUES (?,?,?,?,?,?,?,?,?)", row)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        if stored is None:
            return Accepted(fid, False, calls)
        if (stored["kind"], stored["target"], stored["name"], stored["value"]) != (kind, target, name, float(value)):
            raise FeedbackError(409, "feedback_id", f"feedback {fid!r} was recorded with another reward "
                                                    f"({stored['name']} = {stored['value']:g} for "
                                                    f"{stored['kind']} {stored['target']!r}); the first one stands")
        return Accepted(fid, True, calls)

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

