"""The durable record of a run: tasks, rollouts and spans in one SQLite file (WAL), and a `rewards` view.

Each write is its own committed transaction, so whatever was written before a crash is still there after it;
WAL lets `lightning traces` read while a run writes. One connection serves all threads under a lock: the
writes are small and SQLite serialises writers anyway.

An agent's call k re-sends its whole conversation, so a rollout's calls repeat each other's prompts: kept whole,
their prompt ids and messages would grow with the square of the turns. A call's record keeps them as references to
content-addressed `chunks` instead (SHARED below), each chunk stored once whatever holds it: fixed runs of ids, so a
prompt that extends an earlier one (this rollout's, or the same task's in another) shares every whole chunk of it,
and one message a chunk. A span's chunks are written in its own transaction and counted by triggers, which free a
chunk when the last span holding it is deleted (by anyone: `lightning serve`'s retention deletes spans directly).
`Store.spans` puts the attributes back whole; a span stored whole (a store made before chunks) reads as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from lightning_sdk.agent import output_json
from lightning_sdk.tracing.records import (AGENT, GATEWAY, PROMPT_IDS, REWARD_NAME, REWARD_SPAN, REWARD_VALUE,
                                           SpanRecord)

log = logging.getLogger(__name__)

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS tasks (
    task_id    TEXT PRIMARY KEY,
    payload    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,
    task_id    TEXT NOT NULL,
    group_id   TEXT NOT NULL,
    iteration  INTEGER NOT NULL,
    phase      TEXT NOT NULL,          -- 'train' | 'eval'
    attempt    INTEGER NOT NULL DEFAULT 1,
    model      TEXT,
    status     TEXT NOT NULL,          -- 'running' | 'succeeded' | 'failed' | 'abandoned' | 'untrained'
    output     TEXT,
    reward     REAL,
    error      TEXT,
    traceback  TEXT,
    started_at REAL NOT NULL,
    ended_at   REAL
);
CREATE INDEX IF NOT EXISTS rollouts_by_iteration ON rollouts (phase, iteration);
-- The dashboard's and `lightning traces`' reads walk these instead of every row: a page of rollouts newest first, a
-- group, the counts by status, the reward range.
CREATE INDEX IF NOT EXISTS rollouts_by_start ON rollouts (started_at, rollout_id);
CREATE INDEX IF NOT EXISTS rollouts_by_group ON rollouts (group_id);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts (status, phase, reward);
CREATE TABLE IF NOT EXISTS spans (
    span_id        TEXT PRIMARY KEY,
    trace_id       TEXT NOT NULL,
    parent_id      TEXT,
    rollout_id     TEXT NOT NULL,
    attempt        INTEGER NOT NULL,
    component      TEXT,
    name           TEXT NOT NULL,
    start_ns       INTEGER NOT NULL,
    end_ns         INTEGER NOT NULL,
    status         TEXT NOT NULL,
    status_message TEXT,
    attributes     TEXT NOT NULL,
    events         TEXT NOT NULL,
    source         TEXT NOT NULL DEFAULT 'agent', -- 'gateway': an LLM call's record; 'agent': the rest
    shared         TEXT            -- attributes kept in `chunks`, JSON: lists|texts -> name -> [chunk_id, ...]
);
-- Pieces of calls' attributes, each stored once (SHARED), held by the spans whose `shared` names them (`refs`).
CREATE TABLE IF NOT EXISTS chunks (
    chunk_id INTEGER PRIMARY KEY,
    hash     BLOB NOT NULL UNIQUE,   -- blake2b-128 of body
    body     TEXT NOT NULL,          -- JSON values joined by ', ': a run of a list's items
    refs     INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS spans_by_rollout ON spans (rollout_id, start_ns);
-- The components of a run and the rollouts of one; each rollout's LLM calls counted without reading a span (a query
-- must say source = 'gateway' as this literal, not a bound parameter, for SQLite to use spans_calls).
CREATE INDEX IF NOT EXISTS spans_by_component ON spans (component, rollout_id);
CREATE INDEX IF NOT EXISTS spans_calls ON spans (rollout_id) WHERE source = 'gateway';
-- Rewards are not stored twice: the final one is the rollout's, intermediate ones are reward spans.
CREATE VIEW IF NOT EXISTS rewards (rollout_id, span_id, name, kind, value, created_at) AS
    SELECT rollout_id, span_id, json_extract(attributes, '$."{REWARD_NAME}"'), 'intermediate',
           json_extract(attributes, '$."{REWARD_VALUE}"'), end_ns / 1e9
    FROM spans WHERE name = '{REWARD_SPAN}'
    UNION ALL
    SELECT rollout_id, NULL, 'reward', 'final', reward, ended_at FROM rollouts WHERE reward IS NOT NULL;
"""


# After the `shared` column exists (a store made before it gains it on open). A span's chunks are counted once each
# however often it names one; a span's `shared` is never rewritten (spans never are).
CHUNK_TRIGGERS = """
CREATE TRIGGER IF NOT EXISTS spans_hold_chunks AFTER INSERT ON spans WHEN new.shared IS NOT NULL BEGIN
    UPDATE chunks SET refs = refs + 1
    WHERE chunk_id IN (SELECT value FROM json_tree(new.shared) WHERE type = 'integer');
END;
CREATE TRIGGER IF NOT EXISTS spans_free_chunks AFTER DELETE ON spans WHEN old.shared IS NOT NULL BEGIN
    UPDATE chunks SET refs = refs - 1
    WHERE chunk_id IN (SELECT value FROM json_tree(old.shared) WHERE type = 'integer');
    DELETE FROM chunks
    WHERE refs <= 0 AND chunk_id IN (SELECT value FROM json_tree(old.shared) WHERE type = 'integer');
END;
CREATE TRIGGER IF NOT EXISTS spans_keep_shared BEFORE UPDATE OF shared ON spans BEGIN
    SELECT RAISE(ABORT, 'a span''s shared chunks are never rewritten');
END;
"""

# What a call's record keeps in chunks. Lists: their ids, CHUNK_IDS a chunk, counted from the start, so that a prompt
# which extends another shares all of that one's whole chunks. Texts (JSON text of a list, as the gateway writes
# them): one item a chunk, so a conversation's messages are each stored once.
SHARED_LISTS = (PROMPT_IDS,)
SHARED_TEXTS = ("gen_ai.input.messages", "gen_ai.tool.definitions")
CHUNK_IDS = 256
_MAX_VARIABLES = 500  # chunk ids or hashes in one IN (...) of SQL


@dataclass(frozen=True)
class _Shared:
    """A span's attributes as stored: the JSON of those kept in the row (a SHARED one in its place as null), and the
    chunks of the SHARED ones, by kind ("lists" | "texts") and name, as (hash, body) in order."""

    attributes: str
    pieces: dict[str, dict[str, list[tuple[bytes, str]]]]

    @classmethod
    def none(cls, attributes: dict[str, Any]) -> "_Shared":
        return cls(json.dumps(attributes), {})

    @classmethod
    def of(cls, attributes: dict[str, Any], pieces: dict[str, dict[str, list[tuple[bytes, str]]]]) -> "_Shared":
        named = {name for kind in pieces.values() for name in kind}
        return cls(json.dumps({k: (None if k in named else v) for k, v in attributes.items()}), pieces)

    def write(self, db: sqlite3.Connection, made: list[int]) -> str | None:
        """The span's `shared` column: its chunks' ids, each chunk written where the store lacks it (its id added
        to `made`). Inside the caller's transaction."""
        if not self.pieces:
            return None
        bodies = {h: b for kind in self.pieces.values() for parts in kind.values() for h, b in parts}
        ids = _chunk_ids(db, list(bodies))
        missing = [(h, b) for h, b in bodies.items() if h not in ids]
        if missing:
            db.executemany("INSERT INTO chunks (hash, body) VALUES (?, ?)", missing)
            new = _chunk_ids(db, [h for h, _ in missing])
            made.extend(new.values())
            ids.update(new)
        return json.dumps({kind: {name: [ids[h] for h, _ in parts] for name, parts in named.items()}
                           for kind, named in self.pieces.items()})


class _Chunker:
    """Cuts a call's SHARED attributes into chunks (hash, body). Only what joining the chunks gives back exactly is
    cut; the rest (and empty values) stays whole. The last calls' chunks are remembered by conversation (rollout,
    component, attribute): a call that extends the one before re-uses the chunks of what it repeats, compared as
    values, so each call's JSON and hashing work is mostly its new part. Thread-safe."""

    def __init__(self, remembered: int = 64):
        self._last: OrderedDict[tuple, tuple[Any, list[tuple[bytes, str]]]] = OrderedDict()
        self._remembered = remembered
        self._lock = threading.Lock()

    def pieces(self, record: SpanRecord) -> dict[str, dict[str, list[tuple[bytes, str]]]]:
        pieces: dict[str, dict[str, list[tuple[bytes, str]]]] = {}
        for kind, names, cut in (("lists", SHARED_LISTS, self._list), ("texts", SHARED_TEXTS, self._text)):
            for name in names:
                key = (record.rollout_id, record.component, name)
                with self._lock:
                    last = self._last.get(key)
                value = record.attributes.get(name)
                parts = cut(value, last)
                if parts:
                    pieces.setdefault(kind, {})[name] = parts
                    kept = list(value) if isinstance(value, list) else value  # a list the caller may yet change
                    with self._lock:
                        self._last[key] = (kept, parts)
                        self._last.move_to_end(key)
                        while len(self._last) > self._remembered:
                            self._last.popitem(last=False)
        return pieces

    @staticmethod
    def _list(value: Any, last: tuple[Any, list[tuple[bytes, str]]] | None) -> list[tuple[bytes, str]]:
        """CHUNK_IDS items a chunk, from the start. A whole chunk of the last list is re-used where this list holds
        the same ints (type and value: 1 and True are equal in Python, not in JSON)."""
        if not isinstance(value, list) or not value:
            return []
        parts: list[tuple[bytes, str]] = []
        if last is not None and isinstance(last[0], list):
            before, chunks = last
            for i, chunk in enumerate(chunks):
                start, end = i * CHUNK_IDS, (i + 1) * CHUNK_IDS
                piece, was = value[start:end], before[start:end]
                if end > len(before) or end > len(value) or piece != was or set(map(type, piece)) != {int} or \
                        set(map(type, was)) != {int}:
                    break
                parts.append(chunk)
        for start in range(len(parts) * CHUNK_IDS, len(value), CHUNK_IDS):
            body = json.dumps(value[start:start + CHUNK_IDS])[1:-1]
            parts.append((_hash(body), body))
        return parts

    @staticmethod
    def _text(value: Any, last: tuple[Any, list[tuple[bytes, str]]] | None) -> list[tuple[bytes, str]]:
        """One item a chunk of a JSON list's text. Where it extends the last text (the same items, then more),
        only the new items are read."""
        if not isinstance(value, str) or len(value) < 3:
            return []
        kept: list[tuple[bytes, str]] = []
        rest = value
        if last is not None and isinstance(last[0], str):
            before, chunks = last
            if value == before:
                return chunks
            if value.startswith(before[:-1]) and value[len(before) - 1:len(before) + 1] == ", ":
                kept, rest = chunks, "[" + value[len(before) + 1:]
        try:
            items = json.loads(rest)
            bodies = [json.dumps(item) for item in items] if isinstance(items, list) else []
        except (ValueError, RecursionError):  # not JSON, or nested past Python's limit
            bodies = []
        if kept and (not bodies or _joined([b for _, b in kept] + bodies) != value):
            return _Chunker._text(value, None)  # not an extension after all: read whole
        if not bodies or (not kept and _joined(bodies) != value):
            return []
        return kept + [(_hash(b), b) for b in bodies]


def _chunk_ids(db: sqlite3.Connection, hashes: list[bytes]) -> dict[bytes, int]:
    """The ids of the chunks stored under `hashes`, by hash (those stored)."""
    ids: dict[bytes, int] = {}
    for k in range(0, len(hashes), _MAX_VARIABLES):
        part = hashes[k:k + _MAX_VARIABLES]
        ids.update((bytes(h), i) for h, i in db.execute(
            f"SELECT hash, chunk_id FROM chunks WHERE hash IN ({','.join('?' * len(part))})", part))
    return ids


def _joined(bodies: Sequence[str]) -> str:
    """The JSON text of the list whose items' texts are `bodies` (as json.dumps writes a list)."""
    return "[" + ", ".join(bodies) + "]"


def _hash(body: str) -> bytes:
    return hashlib.blake2b(body.encode(), digest_size=16).digest()


FAILED_EVAL_SCORE = 0.0  # what an eval rollout that failed (no reward) scores: the one rule, used everywhere


SPAN_COLUMNS = ("span_id", "trace_id", "parent_id", "rollout_id", "attempt", "component", "name", "start_ns", "end_ns",
                "status", "status_message", "attributes", "events", "source", "shared")

# rollout_page's sort keys -> the SQL they order by (fixed text: a sort key never reaches SQL itself)
ROLLOUT_SORTS = {
    "started": "started_at", "rollout": "rollout_id", "phase": "phase", "iteration": "iteration",
    "status": "status", "reward": "reward", "seconds": "(ended_at - started_at)", "model": "model",
    "task": "task_id", "output": "output", "error": "error",
    "calls": "(SELECT COUNT(*) FROM spans s WHERE s.rollout_id = rollouts.rollout_id AND s.source = 'gateway')",
    "spans": "(SELECT COUNT(*) FROM spans s WHERE s.rollout_id = rollouts.rollout_id)",
}


def _like(text: str) -> str:
    """A LIKE pattern matching `text` anywhere, its own %, _ and \\ taken literally (ESCAPE '\\')."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def eval_score(reward: float | None) -> float:
    """An eval rollout's score: its reward, or FAILED_EVAL_SCORE when it failed."""
    return FAILED_EVAL_SCORE if reward is None else reward


def connect_read_only(path: str | Path) -> sqlite3.Connection:
    """An existing SQLite file opened read-only, as a reader such as the dashboard opens it: it creates nothing and
    writes nothing (every write fails)."""
    return sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=30)


def connect_tables(path: str | Path, schema: str, *, read_only: bool = False) -> sqlite3.Connection:
    """A connection for one module's tables in a store: `read_only`, as a reader opens it (it creates nothing; a
    table not made yet is sqlite3.OperationalError), else a writer's, autocommit, with `schema` created if missing."""
    if read_only:
        return connect_read_only(path)
    db = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        db.executescript(schema)
    except BaseException:
        db.close()
        raise
    return db


def seal(path: str | Path) -> None:
    """Make a closed store one self-contained file: its write-ahead log folded in and WAL mode left, so a read-only
    reader (`lightning traces`) creates no -wal/-shm beside it. For a store nothing writes to any more."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=DELETE")
    finally:
        db.close()


@dataclass(frozen=True)
class RolloutRecord:
    rollout_id: str
    task_id: str
    group_id: str
    iteration: int
    phase: str
    attempt: int
    model: str | None
    status: str
    output: Any
    reward: float | None
    error: str | None
    traceback: str | None
    started_at: float
    ended_at: float | None

    @property
    def seconds(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.started_at


class Store:
    def __init__(self, path: str | Path, *, read_only: bool = False):
        """`read_only` opens an existing store the way SQLite does read-only (a reader such as the dashboard): it
        creates nothing, writes no schema and leaves the journal mode alone; every write fails."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._chunker = _Chunker()
        self.span_conflicts = 0  # spans refused by write_spans: their id held another span
        self.read_only = read_only
        if read_only:
            self._db = connect_read_only(self.path)
            self._db.row_factory = sqlite3.Row
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives process death
            self._db.executescript(SCHEMA)
            columns = {r["name"] for r in self._db.execute("PRAGMA table_info(spans)")}
            if "source" not in columns:  # a store written before calls were recorded at the gateway
                self._db.execute("ALTER TABLE spans ADD COLUMN source TEXT NOT NULL DEFAULT 'agent'")
            if "shared" not in columns:  # a store written before calls' prompts were shared: its spans stay whole
                self._db.execute("ALTER TABLE spans ADD COLUMN shared TEXT")
            self._db.executescript(CHUNK_TRIGGERS)

    def close(self) -> None:
        """Close; a writer folds its write-ahead log into the file and leaves WAL mode (as `seal`), so a clean exit
        leaves one file and readers of it write nothing beside it. Where another connection (a dashboard) still
        reads it, the log is checkpointed instead and SQLite removes it when the last one closes."""
        with self._lock:
            if not self.read_only:
                try:
                    self._db.execute("PRAGMA journal_mode=DELETE")
                except sqlite3.OperationalError:  # another connection holds it: fold in what can be folded
                    with contextlib.suppress(sqlite3.OperationalError):
                        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, *statements: tuple[str, Iterable[Sequence[Any]]]) -> None:
        """Run (sql, rows) statements as one committed transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, rows in statements:
                    self._db.executemany(sql, rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # --------------------------------------------------------------------------------------------- writes

    def add_tasks(self, tasks: Iterable[tuple[str, dict]]) -> None:
        self._write(("INSERT OR IGNORE INTO tasks (task_id, payload) VALUES (?, ?)",
                     [(tid, json.dumps(payload, default=str)) for tid, payload in tasks]))

    def start_rollout(self, rollout_id: str, *, task_id: str, group_id: str, iteration: int, phase: str,
                      attempt: int = 1, model: str | None = None) -> None:
        self._write((
            "INSERT INTO rollouts (rollout_id, task_id, group_id, iteration, phase, attempt, model, status, started_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, 'running', ?)",
            [(rollout_id, task_id, group_id, iteration, phase, attempt, model, time.time())],
        ))

    def finish_rollout(self, rollout_id: str, *, status: str, output: Any = None, reward: float | None = None,
                       error: str | None = None, traceback: str | None = None) -> None:
        self._write(
            ("UPDATE rollouts SET status=?, output=?, reward=?, error=?, traceback=?, ended_at=? WHERE rollout_id=?",
             [(status, output_json(output), reward, error, traceback, time.time(), rollout_id)]),
        )

    def abandon_running(self) -> int:
        """Mark rollouts left 'running' by a killed process; returns how many (their spans stay)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE rollouts SET status='abandoned', error='process ended before the rollout finished',"
                " ended_at=? WHERE status='running'", (time.time(),))
            return cur.rowcount

    def mark_untrained(self, completed: int) -> int:
        """Mark the finished train rollouts of iterations after `completed` 'untrained': collected by an iteration
        whose update never completed (a killed run), so no checkpoint trained on them; resume collects that
        iteration afresh. What they were stays in `error`. Returns how many."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE rollouts SET status='untrained', error='iteration ' || iteration || ' was not trained: the run"
                " stopped before its update completed (was ' || status || COALESCE(': ' || error, '') || ')'"
                " WHERE phase='train' AND iteration > ? AND status IN ('succeeded', 'failed')", (completed,))
            return cur.rowcount

    def abandon(self, rollout_id: str, error: str) -> bool:
        """Mark one rollout abandoned (its worker died; its spans stay); False if it was never started."""
        with self._lock:
            cur = self._db.execute("UPDATE rollouts SET status='abandoned', error=?, ended_at=? WHERE rollout_id=?",
                                   (error, time.time(), rollout_id))
            return cur.rowcount > 0

    def write_spans(self, records: Sequence[SpanRecord]) -> list[str]:
        """Store an agent's spans (whatever their `source` says: only `write_calls` stores the gateway's); a stored
        span is never replaced. Returns the ids of spans refused because another span with that id but other
        content is already stored (also counted in `span_conflicts`); the same span written again (a retried
        batch) is no conflict."""
        return self._insert_spans(records, AGENT)

    def write_calls(self, records: Sequence[SpanRecord]) -> list[str]:
        """Store the gateway's records of LLM calls (the only writer of `source = 'gateway'`)."""
        return self._insert_spans(records, GATEWAY)

    def _insert_spans(self, records: Sequence[SpanRecord], source: str) -> list[str]:
        # The JSON and hashing outside the lock; a call's chunks are written in the transaction that writes its row,
        # so a row never names a chunk that may not have been written.
        encoded = [(r, _Shared.of(r.attributes, self._chunker.pieces(r)) if source == GATEWAY else
                     _Shared.none(r.attributes),
                    json.dumps(r.events)) for r in records]
        conflicts, displaced, made = [], [], []
        insert = f"INTO spans ({', '.join(SPAN_COLUMNS)}) VALUES ({', '.join('?' * len(SPAN_COLUMNS))})"
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for r, shared, events in encoded:
                    row = (r.span_id, r.trace_id, r.parent_id, r.rollout_id, r.attempt, r.component, r.name,
                           r.start_ns, r.end_ns, r.status, r.status_message, shared.attributes, events, source,
                           shared.write(self._db, made))
                    if self._db.execute(f"INSERT OR IGNORE {insert}", row).rowcount == 0:
                        stored = self._db.execute(f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans WHERE span_id=?",
                                                  (r.span_id,)).fetchone()
                        if tuple(stored) == row:
                            continue
                        if source == GATEWAY and stored["source"] != GATEWAY:
                            # A call's record always wins: an agent or worker span under its id (planted, or a
                            # 1-in-2^64 accident) is dropped, never the record the trainer learns from.
                            self._db.execute("DELETE FROM spans WHERE span_id=?", (r.span_id,))
                            self._db.execute(f"INSERT {insert}", row)
                            displaced.append(r.span_id)
                        else:
                            conflicts.append(r.span_id)
                for k in range(0, len(made) if conflicts else 0, _MAX_VARIABLES):  # made for a refused span
                    part = made[k:k + _MAX_VARIABLES]
                    self._db.execute(f"DELETE FROM chunks WHERE refs <= 0 AND chunk_id IN "
                                     f"({','.join('?' * len(part))})", part)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self.span_conflicts += len(conflicts) + len(displaced)
        if displaced:
            log.warning("store: %d span(s) sent by agents or workers dropped: they held the ids of LLM calls' records "
                        "(the records are kept): %s", len(displaced), ", ".join(displaced[:3]))
        if conflicts:
            log.warning("store: %d span(s) not stored, their ids are taken by other spans (kept): %s",
                        len(conflicts), ", ".join(conflicts[:3]))
        return conflicts

    # ---------------------------------------------------------------------------------------------- reads

    def spans(self, rollout_id: str) -> list[SpanRecord]:
        """The rollout's spans, in the order they started; a call's shared attributes put back whole."""
        return self._spans("rollout_id=? ORDER BY start_ns, end_ns", (rollout_id,))

    def span(self, span_id: str) -> SpanRecord | None:
        """One span by its id (a primary-key lookup), or None."""
        found = self._spans("span_id=?", (span_id,))
        return found[0] if found else None

    def _spans(self, where: str, args: tuple) -> list[SpanRecord]:
        """The spans `where` selects, a call's shared attributes put back whole."""
        with self._lock:
            # one read transaction: the chunks read are those of the spans read, whatever deletes spans meanwhile
            self._db.execute("BEGIN")
            try:
                rows = self._db.execute(f"SELECT * FROM spans WHERE {where}", args).fetchall()
                shared = {r["span_id"]: json.loads(r["shared"]) for r in rows
                          if "shared" in r.keys() and r["shared"] is not None}
                wanted = sorted({i for s in shared.values() for named in s.values() for ids in named.values()
                                 for i in ids})
                bodies: dict[int, str] = {}
                for k in range(0, len(wanted), _MAX_VARIABLES):
                    part = wanted[k:k + _MAX_VARIABLES]
                    bodies.update(self._db.execute(f"SELECT chunk_id, body FROM chunks WHERE chunk_id IN "
                                                   f"({','.join('?' * len(part))})", part).fetchall())
            finally:
                self._db.execute("COMMIT")
        out = []
        for r in rows:
            attributes = json.loads(r["attributes"])
            for kind, named in shared.get(r["span_id"], {}).items():
                for name, ids in named.items():
                    if any(i not in bodies for i in ids):
                        log.error("store: span %s: a chunk of its %s is missing; the attribute is left out",
                                  r["span_id"], name)
                        attributes.pop(name, None)
                        continue
                    text = _joined([bodies[i] for i in ids])
                    attributes[name] = json.loads(text) if kind == "lists" else text
            out.append(SpanRecord(
                span_id=r["span_id"], trace_id=r["trace_id"], parent_id=r["parent_id"], rollout_id=r["rollout_id"],
                attempt=r["attempt"], component=r["component"], name=r["name"], start_ns=r["start_ns"],
                end_ns=r["end_ns"], status=r["status"], status_message=r["status_message"],
                attributes=attributes, events=json.loads(r["events"]), source=r["source"]))
        return out

    def rollouts(self, *, phase: str | None = None, iteration: int | None = None, status: str | None = None,
                 limit: int | None = None, newest_first: bool = False) -> list[RolloutRecord]:
        where, args = [], []
        for col, val in (("phase", phase), ("iteration", iteration), ("status", status)):
            if val is not None:
                where.append(f"{col}=?")
                args.append(val)
        sql = "SELECT * FROM rollouts" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY started_at DESC, rollout_id DESC" if newest_first else " ORDER BY started_at, rollout_id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [self._rollout(r) for r in self._read(sql, args)]

    def rollout(self, rollout_id: str) -> RolloutRecord | None:
        rows = self._read("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,))
        return self._rollout(rows[0]) if rows else None

    def task(self, task_id: str) -> dict | None:
        rows = self._read("SELECT payload FROM tasks WHERE task_id=?", (task_id,))
        return json.loads(rows[0]["payload"]) if rows else None

    def task_ids(self, phase: str) -> set[str]:
        """The tasks the store has rollouts of in `phase` ('train': the tasks trained on)."""
        return {r["task_id"] for r in self._read("SELECT DISTINCT task_id FROM rollouts WHERE phase=?", (phase,))}

    def call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """LLM calls (the gateway's records, `records.is_llm_call`) per rollout."""
        if not rollout_ids:
            return {}
        marks = ",".join("?" * len(rollout_ids))
        rows = self._read(f"SELECT rollout_id, COUNT(*) AS n FROM spans WHERE rollout_id IN ({marks})"
                          f" AND source = ? GROUP BY rollout_id", [*rollout_ids, GATEWAY])
        return {r["rollout_id"]: r["n"] for r in rows}

    def rollout_page(self, *, status: str | None = None, phase: str | None = None, iteration: int | None = None,
                     min_reward: float | None = None, max_reward: float | None = None, component: str | None = None,
                     search: str | None = None, group_id: str | None = None, sort: str = "started",
                     descending: bool = True, limit: int = 50,
                     offset: int = 0) -> tuple[int, list[RolloutRecord]]:
        """(how many match, one page of them, newest first unless `sort` names another of ROLLOUT_SORTS): the
        filters run in SQL, so a big store is never loaded whole. `search` is plain text looked for in the output
        and the task (LIKE, case-insensitive for ASCII; its % and _ match themselves)."""
        if sort not in ROLLOUT_SORTS:
            raise ValueError(f"sort {sort!r}: expected one of {sorted(ROLLOUT_SORTS)}")
        where, args = [], []
        for col, op, val in (("status", "=", status), ("phase", "=", phase), ("iteration", "=", iteration),
                             ("reward", ">=", min_reward), ("reward", "<=", max_reward), ("group_id", "=", group_id)):
            if val is not None:
                where.append(f"{col} {op} ?")
                args.append(val)
        if component is not None:
            where.append("rollout_id IN (SELECT rollout_id FROM spans WHERE component = ?)")
            args.append(component)
        if search:
            # the payload is JSON text: look for the text as json.dumps wrote it (quotes, non-ASCII escaped)
            where.append("(output LIKE ? ESCAPE '\\' OR task_id LIKE ? ESCAPE '\\'"
                         " OR task_id IN (SELECT task_id FROM tasks WHERE payload LIKE ? ESCAPE '\\'))")
            args += [_like(search), _like(search), _like(json.dumps(search)[1:-1])]
        cond = (" WHERE " + " AND ".join(where)) if where else ""
        total = self._read(f"SELECT COUNT(*) AS n FROM rollouts{cond}", args)[0]["n"]
        way = "DESC" if descending else "ASC"
        keys = [f"{ROLLOUT_SORTS[sort]} {way} NULLS LAST"] if sort != "started" else []  # one key: rollouts_by_start
        order = ", ".join([*keys, f"started_at {way}", f"rollout_id {way}"])
        rows = self._read(f"SELECT * FROM rollouts{cond} ORDER BY {order} LIMIT ? OFFSET ?",
                          [*args, int(limit), max(0, int(offset))])
        return total, [self._rollout(r) for r in rows]

    def status_counts(self) -> dict[str, int]:
        return {r["status"]: r["n"] for r in self._read("SELECT status, COUNT(*) AS n FROM rollouts GROUP BY status")}

    def reward_range(self, phase: str = "train") -> list[float] | None:
        """[lowest, highest] reward of the scored rollouts of `phase`; None before any."""
        scored = "FROM rollouts WHERE status = 'succeeded' AND phase = ? AND reward IS NOT NULL"
        # two subqueries: SQLite reads a lone MIN or MAX off rollouts_by_status's end, both in one query scan it
        (row,) = self._read(f"SELECT (SELECT MIN(reward) {scored}) AS lo, (SELECT MAX(reward) {scored}) AS hi",
                            (phase, phase))
        return None if row["lo"] is None else [float(row["lo"]), float(row["hi"])]

    def components(self) -> list[str]:
        """Every component a span or call of the run names, in order: one step along spans_by_component per
        component, however many spans (a store made before that index: one pass over the spans)."""
        if not self._read("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'spans_by_component'"):
            return [r["component"] for r in self._read(
                "SELECT DISTINCT component FROM spans WHERE component IS NOT NULL ORDER BY component")]
        return [r["component"] for r in self._read(
            "WITH RECURSIVE c(component) AS (SELECT MIN(component) FROM spans UNION ALL SELECT (SELECT MIN(component)"
            " FROM spans WHERE component > c.component) FROM c WHERE c.component IS NOT NULL)"
            " SELECT component FROM c WHERE component IS NOT NULL")]

    def span_counts(self, rollout_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """(LLM calls, all spans) per rollout."""
        if not rollout_ids:
            return {}
        marks = ",".join("?" * len(rollout_ids))
        rows = self._read(f"SELECT rollout_id, COUNT(*) AS spans, SUM(source = ?) AS calls FROM spans"
                          f" WHERE rollout_id IN ({marks}) GROUP BY rollout_id", [GATEWAY, *rollout_ids])
        return {r["rollout_id"]: (r["calls"], r["spans"]) for r in rows}

    def eval_scores(self) -> list[dict]:
        """Per eval iteration: the mean score of its finished rollouts (`eval_score`), its standard error (sample
        std / sqrt(n); None below two), how many finished, how many still run."""
        rows = self._read(
            "SELECT iteration, AVG(CASE WHEN status != 'running' THEN COALESCE(reward, ?) END) AS mean,"
            " AVG(CASE WHEN status != 'running' THEN COALESCE(reward, ?) * COALESCE(reward, ?) END) AS mean_sq,"
            " SUM(status != 'running') AS finished, SUM(status = 'running') AS running FROM rollouts"
            " WHERE phase = 'eval' GROUP BY iteration ORDER BY iteration", (FAILED_EVAL_SCORE,) * 3)
        out = []
        for r in map(dict, rows):
            n, mean, mean_sq = r["finished"] or 0, r["mean"], r.pop("mean_sq")
            r["stderr"] = (math.sqrt(max(0.0, mean_sq - mean * mean) * n / (n - 1) / n)
                           if n > 1 and mean_sq is not None and math.isfinite(mean_sq) else None)
            out.append(r)
        return out

    def rewards(self, rollout_id: str) -> list[dict]:
        """Intermediate rewards (reward spans) in the order they were emitted, then the final one."""
        rows = self._read("SELECT name, kind, value, span_id FROM rewards WHERE rollout_id=? "
                          "ORDER BY kind = 'final', created_at", (rollout_id,))
        return [dict(r) for r in rows]

    def count(self, table: str) -> int:
        if table not in ("tasks", "rollouts", "spans", "rewards"):
            raise ValueError(f"unknown table {table!r}")
        return self._read(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]

    @staticmethod
    def _rollout(r: sqlite3.Row) -> RolloutRecord:
        return RolloutRecord(
            rollout_id=r["rollout_id"], task_id=r["task_id"], group_id=r["group_id"], iteration=r["iteration"],
            phase=r["phase"], attempt=r["attempt"], model=r["model"], status=r["status"],
            output=json.loads(r["output"]) if r["output"] is not None else None, reward=r["reward"],
            error=r["error"], traceback=r["traceback"], started_at=r["started_at"], ended_at=r["ended_at"])
