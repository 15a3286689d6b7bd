"""A `lightning serve` directory's versions for the dashboard, read-only: each update's candidate in order with the
gate's decision and its numbers, its canary's verdict if it had one, what became of it (promoted, rejected, rolled
back) and when, and the live reward of every adapter that served (production.live_reward: mean ± standard error
over rewarded episodes).

Everything comes from the serving store's tables (`learn_updates`, `promotions`, `canaries`, the calls and their
feedback), opened read-only while the server writes; a table a store does not have yet (no [learn], no canary)
reads as empty.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict
from pathlib import Path
from statistics import fmean
from typing import Any

from lightning_sdk.production import canary, gate, live_reward
from lightning_sdk.production.deployment import STORE_FILE as SERVE_FILE
from lightning_sdk.store import connect_read_only

__all__ = ["SERVE_FILE", "live_rewards", "outcome", "timeline"]


def _read(fn, empty):
    try:
        return fn()
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return empty
        raise


_LIVE: dict[tuple[Path, str], live_reward.LiveLog] = {}  # each serve store's live reward, kept between polls
_LIVE_KEPT = 16  # stores whose views are kept (the oldest one seen is dropped past it)


def live_rewards(path: Path, reward_name: str) -> dict[str, live_reward.Live]:
    """Each adapter's live reward in the store at `path`, reading only what arrived since this process's last poll."""
    key = (Path(path).resolve(), reward_name)
    view = _LIVE.pop(key, None) or live_reward.LiveLog(key[0], reward_name)
    _LIVE[key] = view  # the most recent last
    while len(_LIVE) > _LIVE_KEPT:
        del _LIVE[next(iter(_LIVE))]
    return view.summaries()


def _updates(path: Path) -> list[dict[str, Any]]:
    db = connect_read_only(path)
    try:
        rows = db.execute("SELECT version, made_at, adapter, evidence FROM learn_updates ORDER BY version").fetchall()
    finally:
        db.close()
    return [{"version": v, "made_at": at, "adapter": name, "evidence": json.loads(e)} for v, at, name, e in rows]


def outcome(decision: gate.Decision | None, trial: dict[str, Any] | None) -> str:
    """What became of a candidate, in words the page shows."""
    if decision is None:
        return "not decided yet"  # its gate is running, or its eval failed (not retried)
    if not decision.promoted:
        passed = decision.lower_bound is not None and decision.lower_bound >= -decision.margin
        return "passed the gate, not served (a canary was running)" if passed else "rejected by the gate"
    if trial is None:
        return "promoted"
    if trial["promoted"] is None:
        return "canary running"
    return "promoted after its canary" if trial["promoted"] else "rolled back by its canary"


def timeline(path: Path, reward_name: str = "reward") -> dict[str, Any]:
    """{versions: [...], serving: the adapter promoted last (None: the base model), reward_name}; each version:
    version (0: the base model), adapter, made_at, rewards/calls the update trained on, parent (the version it was
    trained from), gate, canary, outcome,
    decided_at, live (mean, stderr, episodes, or None)."""
    updates = _read(lambda: _updates(path), [])
    decided = {d.candidate: (at, d) for at, d in _read(lambda: gate.timed(path, read_only=True), [])}
    trials = {c["candidate"]: c for c in _read(lambda: canary.history(path, read_only=True), [])}
    live = _read(lambda: live_rewards(path, reward_name), {})
    mine = {u["adapter"] for u in updates}
    # The base model (and anything else that served without being an update): by the names the calls recorded,
    # else the name the first gate compared against.
    first = next(iter(decided.values()), None)
    base = sorted(set(live) - mine) or ([first[1].serving] if first else [])
    rows: list[dict[str, Any]] = [{"version": 0, "adapter": name, "made_at": None, "rewards": None, "calls": None,
                                   "parent": None, "gate": None, "canary": None, "outcome": "base model", "decided_at": None}
                                  for name in base]
    for u in updates:
        at, d = decided.get(u["adapter"], (None, None))
        trial = trials.get(u["adapter"])
        rows.append({
            "version": u["version"], "adapter": u["adapter"], "made_at": u["made_at"],
            "rewards": u["evidence"].get("rewards"), "calls": u["evidence"].get("calls"),
            # the version it was trained from (the one in service then); evidence without it: the version before
            "parent": u["evidence"].get("parent", u["version"] - 1),
            "gate": None if d is None else {
                **{k: v for k, v in asdict(d).items() if k not in ("candidate", "candidate_scores", "serving_scores")},
                # the two adapters' eval scores, each over the same tasks and seeds
                "candidate_mean": fmean(d.candidate_scores) if d.candidate_scores else None,
                "serving_mean": fmean(d.serving_scores) if d.serving_scores else None},
            "canary": None if trial is None else {"started_at": trial["started_at"], "share": trial["share"],
                                                  **(trial["evidence"] or {})},
            "outcome": outcome(d, trial),
            "decided_at": trial["decided_at"] if trial is not None and trial["decided_at"] else at,
        })
    promoted = [r["adapter"] for r in rows if r["outcome"].startswith("promoted")]
    for r in rows:
        r["live"] = asdict(live[r["adapter"]]) if r["adapter"] in live else None
    return {"versions": rows, "serving": promoted[-1] if promoted else None, "reward_name": reward_name}
