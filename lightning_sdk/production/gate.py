"""The gate before promotion: a candidate adapter replaces the serving one only if, on the same seeded eval tasks,
it is not worse by more than `margin`, with confidence.

Scores are paired (task i scored by both, with the same seed: evals.eval_seed), so the test is on the differences
d_i = candidate_i - serving_i: promote iff mean(d) - z * se(d) >= -margin, se the standard error of the mean
difference (sample std / sqrt(n)). Pairing removes the tasks' own difficulty from the noise; `z` (default 1.645,
one-sided 95%) makes a lucky small sample no reason to promote. Fewer than two tasks: never promoted.
Every decision is stored with its evidence (the scores, the numbers, the rule) in the store's `promotions` table.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from lightning_sdk.store import connect_tables

DEFAULT_Z = 1.645

SCHEMA = """
CREATE TABLE IF NOT EXISTS promotions (
    decided_at REAL NOT NULL,
    candidate  TEXT NOT NULL,
    serving    TEXT NOT NULL,
    promoted   INTEGER NOT NULL,
    evidence   TEXT NOT NULL      -- the Decision as JSON
);
"""


@dataclass(frozen=True)
class Decision:
    candidate: str
    serving: str
    promoted: bool
    mean_difference: float | None  # candidate - serving, over the tasks
    stderr: float | None
    lower_bound: float | None  # mean_difference - z * stderr
    margin: float
    z: float
    tasks: int
    candidate_scores: list[float]
    serving_scores: list[float]
    reason: str


def decide(candidate: str, candidate_scores: Sequence[float], serving: str, serving_scores: Sequence[float], *,
           margin: float, z: float = DEFAULT_Z) -> Decision:
    """Promote `candidate` over `serving`? Scores: one per eval task, in the same task order."""
    if len(candidate_scores) != len(serving_scores):
        raise ValueError(f"candidate_scores: {len(candidate_scores)} scores for {len(serving_scores)} tasks: expected "
                         "one per task, in the serving scores' order")
    if not (margin >= 0 and math.isfinite(margin)) or not (z >= 0 and math.isfinite(z)):
        raise ValueError(f"margin = {margin!r}, z = {z!r}: expected finite numbers >= 0")
    c, s = [float(v) for v in candidate_scores], [float(v) for v in serving_scores]
    kept = dict(candidate=candidate, serving=serving, margin=margin, z=z, tasks=len(c), candidate_scores=c,
                serving_scores=s)
    if not all(math.isfinite(v) for v in c + s):
        return Decision(promoted=False, mean_difference=None, stderr=None, lower_bound=None,
                        reason="a score is not a finite number: nothing non-finite is promoted", **kept)
    if len(c) < 2:
        return Decision(promoted=False, mean_difference=None, stderr=None, lower_bound=None,
                        reason=f"{len(c)} eval task(s): at least 2 are needed for a standard error", **kept)
    d = [a - b for a, b in zip(c, s)]
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))
    lower = mean - z * se
    promoted = lower >= -margin
    reason = (f"mean difference {mean:+.4f} ± {se:.4f} (se), lower bound {lower:+.4f} "
              f"{'>=' if promoted else '<'} -margin {-margin:+.4f}")
    return Decision(promoted=promoted, mean_difference=mean, stderr=se, lower_bound=lower, reason=reason, **kept)


def record(path: str | Path, decision: Decision) -> None:
    """Store the decision with its evidence (one committed row)."""
    db = connect_tables(path, SCHEMA)
    try:
        insert(db, decision)
    finally:
        db.close()


def insert(db: sqlite3.Connection, decision: Decision) -> None:
    """The decision's row on `db` (a connection with SCHEMA made), committed with the caller's transaction: a pass
    and the canary it starts are one commit (production.promotion)."""
    db.execute("INSERT INTO promotions VALUES (?, ?, ?, ?, ?)", (time.time(), decision.candidate,
               decision.serving, int(decision.promoted), json.dumps(asdict(decision))))


def decisions(path: str | Path) -> list[Decision]:
    return [d for _, d in timed(path)]


def timed(path: str | Path, *, read_only: bool = False) -> list[tuple[float, Decision]]:
    """Every decision, in order, with when it was made (unix seconds); `read_only`: a reader's (sqlite3.
    OperationalError where the table does not exist)."""
    db = connect_tables(path, SCHEMA, read_only=read_only)
    try:
        return [(r[0], Decision(**json.loads(r[1])))
                for r in db.execute("SELECT decided_at, evidence FROM promotions ORDER BY rowid")]
    finally:
        db.close()
