"""A canary before full promotion: a candidate that passed the gate serves `share` of new episodes beside the
serving adapter, then is promoted to all traffic or rolled back by the live rewards of the two over the same window.

Routing is by episode (trace id, gateway.canary_share), so one episode stays on one adapter and the record's policy
attribute names which served each call.

The rule (docs/serve.md): once each side has at least `min_rewards` rewarded episodes since the canary started,
with c and s the two sides' per-episode rewards (production.live_reward: the episode is the unit, since its calls
share one reward), d = mean(c) - mean(s) and se = sqrt(var(c)/n_c + var(s)/n_s) (the two samples are different
episodes, so Welch's standard error, not the gate's paired one): promote iff d - z * se >= -margin, else roll back:
the gate's bound on live traffic. A canary and its decision are rows of the store's `canaries` table, so a restart
(kill -9) resumes the canary it was running, or serves what was decided.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from lightning_sdk.production import live_reward
from lightning_sdk.store import connect_tables

SCHEMA = """
CREATE TABLE IF NOT EXISTS canaries (
    started_at REAL NOT NULL,
    candidate  TEXT NOT NULL,
    serving    TEXT NOT NULL,
    share      REAL NOT NULL,
    decided_at REAL,              -- null while the canary runs
    promoted   INTEGER,
    evidence   TEXT               -- the Verdict as JSON
);
"""


@dataclass(frozen=True)
class Verdict:
    candidate: str
    serving: str
    promoted: bool
    mean_difference: float  # canary - serving, per rewarded episode
    stderr: float
    lower_bound: float  # mean_difference - z * stderr
    margin: float
    z: float
    canary_rewards: int  # rewarded episodes (a call of no episode rewarded by its id counts as one)
    serving_rewards: int
    canary_mean: float
    serving_mean: float
    reason: str
    left_out: int = 0  # episodes of either side whose reward is not a finite number


def judge(candidate: str, canary: Sequence[float], serving: str, served: Sequence[float], *, min_rewards: int,
          margin: float, z: float) -> Verdict | None:
    """The canary's verdict, or None while either side has fewer than `min_rewards` (>= 2) rewarded episodes;
    `canary` and `served`: one reward per episode (live_reward.by_adapter). Never raises on the values: a non-finite
    one is left out (counted: `left_out`), and the rule is computed in units of the largest magnitude
    (live_reward.moments), so a reward near the float limit decides like any other; a reported number beyond float
    is inf (stored as null)."""
    c = [float(v) for v in canary if math.isfinite(v)]
    s = [float(v) for v in served if math.isfinite(v)]
    left_out = len(canary) + len(served) - len(c) - len(s)
    if len(c) < max(2, min_rewards) or len(s) < max(2, min_rewards):
        return None
    scale = live_reward.magnitude(c, s)
    (mc, vc), (ms, vs) = live_reward.moments(c, scale), live_reward.moments(s, scale)
    du, seu = mc - ms, math.sqrt(vc / len(c) + vs / len(s))  # in units of `scale`: each within a few units
    promoted = du - z * seu >= -margin / scale
    d, se, lower = du * scale, seu * scale, (du - z * seu) * scale  # a product beyond float is inf, never an error
    dropped = f" ({left_out} episode reward(s) not finite, left out)" if left_out else ""
    return Verdict(candidate, serving, promoted, d, se, lower, margin, z, len(c), len(s), live_reward.mean_of(c),
                   live_reward.mean_of(s),
                   f"live mean difference {d:+.4g} ± {se:.4g} (se), lower bound {lower:+.4g} "
                   f"{'>=' if promoted else '<'} -margin {-margin:+.4f}: "
                   f"{'promoted' if promoted else 'rolled back'}{dropped}", left_out)


@dataclass(frozen=True)
class Running:
    started_at: float
    candidate: str
    serving: str
    share: float


def _execute(path: str | Path, sql: str, args: tuple = (), *, read_only: bool = False) -> list[tuple]:
    """One statement on its own connection, committed (autocommit) before it returns; `read_only`: a reader's
    (sqlite3.OperationalError where the table does not exist)."""
    db = connect_tables(path, SCHEMA, read_only=read_only)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def start(path: str | Path, candidate: str, serving: str, share: float) -> Running:
    """A committed row before the first episode is routed to the canary."""
    db = connect_tables(path, SCHEMA)
    try:
        return insert(db, candidate, serving, share)
    finally:
        db.close()


def insert(db: sqlite3.Connection, candidate: str, serving: str, share: float) -> Running:
    """The canary's row on `db` (a connection with SCHEMA made), committed with the caller's transaction: the gate's
    pass and its canary are one commit (production.promotion), so no restart finds the one without the other."""
    now = time.time()
    db.execute("INSERT INTO canaries (started_at, candidate, serving, share) VALUES (?, ?, ?, ?)",
               (now, candidate, serving, share))
    return Running(now, candidate, serving, share)


def running(path: str | Path) -> Running | None:
    """The canary undecided in the store, if any (a restart resumes it)."""
    rows = _execute(path, "SELECT started_at, candidate, serving, share FROM canaries WHERE decided_at IS NULL "
                          "ORDER BY rowid DESC LIMIT 1")
    return Running(*rows[0]) if rows else None


def conclude(path: str | Path, verdict: Verdict) -> None:
    """The verdict stored with its evidence on the canary's own row (set once: a decided row is never rewritten)."""
    evidence = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in asdict(verdict).items()}
    _execute(path, "UPDATE canaries SET decided_at=?, promoted=?, evidence=? WHERE candidate=? AND decided_at IS NULL",
             (time.time(), int(verdict.promoted), json.dumps(evidence, allow_nan=False), verdict.candidate))


def history(path: str | Path, *, read_only: bool = False) -> list[dict]:
    """Every canary, started and decided, in order: {started_at, candidate, serving, share, decided_at, promoted,
    evidence (a dict or None)}."""
    rows = _execute(path, "SELECT started_at, candidate, serving, share, decided_at, promoted, evidence FROM canaries "
                          "ORDER BY rowid", read_only=read_only)
    return [dict(started_at=r[0], candidate=r[1], serving=r[2], share=r[3], decided_at=r[4],
                 promoted=None if r[5] is None else bool(r[5]), evidence=json.loads(r[6]) if r[6] else None)
            for r in rows]
