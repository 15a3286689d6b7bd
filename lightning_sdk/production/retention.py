"""What `lightning serve` keeps, and for how long: stored calls (the spans table: prompts and replies, token ids,
sampler log-probs) older than the retention window are deleted, and past `max_calls` the oldest calls go first,
except a call an unconsumed reward still needs (with [learn]: it may yet be trained on). A reward's row goes (with
its `learn_consumed` row) in the pass that deletes the last of the calls it scores, except the newest row of all:
SQLite gives a new row one above the largest rowid, so keeping that one means no rowid is ever given twice, and
the readers that follow feedback by rowid (the ledger's unread range, production.reward_log, the dashboard's live
reward) never miss a row. A row goes only with all its calls, which the deletion log already tells those readers.

Each pass is one SQLite transaction: a kill -9 leaves it done or not begun. The calls a pass deletes are listed in
`pruned_calls` (PRUNED) in the same transaction, kept PRUNED_KEEP_S, so a reader that keeps a view of the log
(production.reward_log, the dashboard's live reward) takes in what left without reading the whole store again.
A call deleted by age could no longer be rewarded (feedback for it was refused, 410, before it went; after, the
answer is 404); one deleted by the cap was inside the window, so feedback for it gets 404 too.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_sdk.production.periodic import Periodic
from lightning_sdk.tracing.records import GATEWAY

log = logging.getLogger("lightning_sdk")

PRUNE_EVERY_S = 60.0  # how often a serve looks for calls to delete (each pass one transaction)
PRUNED = "pruned_calls"
PRUNED_KEEP_S = 86400.0  # a reader further behind than this reads the whole log again

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {PRUNED} (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,  -- in deletion order, never given twice
    span_rowid INTEGER NOT NULL,                   -- the deleted call's rowid in spans
    span_id    TEXT NOT NULL,
    rollout_id TEXT NOT NULL,
    at         REAL NOT NULL                       -- the pass's time (unix seconds)
);
"""

# The spans an unconsumed reward named :name needs: every span of its episode, and the call it names.
NEEDED = """
    s.rollout_id IN (SELECT f.rollout_id FROM feedback f WHERE f.name=:name AND f.rollout_id IS NOT NULL
                     AND NOT EXISTS (SELECT 1 FROM learn_consumed c WHERE c.feedback_id=f.feedback_id))
    OR s.span_id IN (SELECT f.call_id FROM feedback f WHERE f.name=:name AND f.call_id IS NOT NULL
                     AND NOT EXISTS (SELECT 1 FROM learn_consumed c WHERE c.feedback_id=f.feedback_id))
"""


def pruned_since(db: sqlite3.Connection, after: int) -> tuple[list[tuple[int, int, str, str]], bool]:
    """The calls deleted after seq `after` in the store `db` reads, in order: (seq, span_rowid, span_id, rollout_id);
    and whether the log was trimmed past `after` (a reader that far behind reads the whole log again). A store
    retention never pruned has no log: nothing deleted."""
    try:
        last = db.execute("SELECT seq FROM sqlite_sequence WHERE name=?", (PRUNED,)).fetchone()
        gone = db.execute(f"SELECT seq, span_rowid, span_id, rollout_id FROM {PRUNED} WHERE seq>? ORDER BY seq",
                          (after,)).fetchall()
    except sqlite3.OperationalError as e:
        if "no such table" not in str(e):
            raise
        return [], False
    trimmed = last is not None and last[0] > after and (not gone or gone[0][0] != after + 1)
    return [tuple(g) for g in gone], trimmed


# The rewards none of whose calls is stored, but the newest reward (its rowid is the next one's floor). `:all`: 1
# looks at every row (the first pass after a start: the store may hold rewards whose calls were deleted while
# rewards were kept), 0 only at the rows of the calls and episodes this pass deleted (the temporary table `gone`).
ORPHANED = """
    SELECT f.feedback_id FROM feedback f WHERE f.rowid < (SELECT MAX(rowid) FROM feedback) AND (
        (f.kind = 'episode_id' AND (:all OR f.rollout_id IN (SELECT rollout_id FROM gone))
         AND NOT EXISTS (SELECT 1 FROM spans s WHERE s.rollout_id = f.rollout_id AND s.source = :gateway))
        OR (f.kind != 'episode_id' AND (:all OR f.call_id IN (SELECT span_id FROM gone))
            AND NOT EXISTS (SELECT 1 FROM spans s WHERE s.span_id = f.call_id AND s.source = :gateway)))
"""


@dataclass(frozen=True)
class Pruned:
    aged: int  # spans deleted: older than the retention window
    over_cap: int  # calls deleted: the oldest beyond max_calls
    kept: int  # calls past the window kept, since an unconsumed reward needs them
    feedback: int = 0  # rewards deleted with the last of their calls


def prune(path: str | Path, *, retention_s: float, max_calls: int | None, reward_name: str | None,
          now: float | None = None, sweep: bool = False) -> Pruned:
    """One pass over the store at `path` (which has the ledger's tables). `reward_name`: the feedback a learner
    still reads (None: no learner, no call is kept for a reward). `sweep`: look at every reward for calls gone,
    not only at those of this pass's deletions (once at start: a store may hold rewards whose calls went before)."""
    now = time.time() if now is None else now
    cutoff_ns = int((now - retention_s) * 1e9)
    needed = f"({NEEDED})" if reward_name is not None else "0"
    args = {"name": reward_name, "cutoff": cutoff_ns, "gateway": GATEWAY}
    db = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        db.executescript(SCHEMA)
        db.execute("BEGIN IMMEDIATE")
        try:
            gone = db.execute(f"DELETE FROM spans WHERE span_id IN (SELECT s.span_id FROM spans s WHERE "
                              f"s.end_ns < :cutoff AND NOT {needed}) RETURNING rowid, span_id, rollout_id, source",
                              args).fetchall()
            aged = len(gone)
            over = 0
            if max_calls is not None:  # the newest max_calls calls stay, the needed ones among them
                capped = db.execute(
                    f"DELETE FROM spans WHERE span_id IN (SELECT s.span_id FROM spans s WHERE s.source=:gateway "
                    f"AND NOT {needed} ORDER BY s.end_ns DESC LIMIT -1 OFFSET :cap - (SELECT COUNT(*) FROM spans s "
                    f"WHERE s.source=:gateway AND {needed})) RETURNING rowid, span_id, rollout_id, source",
                    {**args, "cap": max_calls}).fetchall()
                over = len(capped)
                gone += capped
            db.executemany(f"INSERT INTO {PRUNED} (span_rowid, span_id, rollout_id, at) VALUES (?, ?, ?, ?)",
                           [(r, s, rid, now) for r, s, rid, source in gone if source == GATEWAY])
            calls = [(s, rid) for _r, s, rid, source in gone if source == GATEWAY]
            dropped = 0
            ledger = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='feedback'").fetchone()
            if ledger is not None and (calls or sweep):
                db.execute("CREATE TEMP TABLE IF NOT EXISTS gone (span_id TEXT, rollout_id TEXT)")
                db.execute("DELETE FROM gone")
                db.executemany("INSERT INTO gone VALUES (?, ?)", calls)
                fids = db.execute(ORPHANED, {"all": int(sweep), "gateway": GATEWAY}).fetchall()
                db.executemany("DELETE FROM learn_consumed WHERE feedback_id=?", fids)
                db.executemany("DELETE FROM feedback WHERE feedback_id=?", fids)
                dropped = len(fids)
            db.execute(f"DELETE FROM {PRUNED} WHERE at < ?", (now - PRUNED_KEEP_S,))
            kept = db.execute(f"SELECT COUNT(*) FROM spans s WHERE s.source=:gateway AND s.end_ns < :cutoff AND "
                              f"{needed}", args).fetchone()[0]
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    finally:
        db.close()
    return Pruned(aged, over, kept, dropped)


class Pruner:
    """A background thread that prunes every PRUNE_EVERY_S (and once at start), logging what it deleted."""

    def __init__(self, path: str | Path, *, retention_s: float, max_calls: int | None, reward_name: str | None,
                 every_s: float = PRUNE_EVERY_S):
        self.path, self.retention_s, self.max_calls, self.reward_name = path, retention_s, max_calls, reward_name
        self.every_s = every_s
        self.last: Pruned | None = None
        self._thread = Periodic(self.run_once, every_s, name="lightning-prune",
                                on_failure="retention: a pass failed; nothing of it was deleted")

    @property
    def failures(self) -> int:
        return self._thread.failures

    def start(self) -> None:
        self.run_once(sweep=True)
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    def run_once(self, sweep: bool = False) -> Pruned:
        p = prune(self.path, retention_s=self.retention_s, max_calls=self.max_calls, reward_name=self.reward_name,
                  sweep=sweep)
        self.last = p
        if p.aged or p.over_cap or p.feedback:
            log.info("retention: deleted %d span(s) past the window, %d call(s) past the cap and %d reward(s) with "
                     "the last of their calls (%d kept for unconsumed rewards)", p.aged, p.over_cap, p.feedback,
                     p.kept)
        return p
