"""Reading run directories for the dashboard, read-only: the runs under a root, a run's iterations and evals,
its rollouts (filtered, one page at a time) and one rollout as a timeline.

A run may be writing while it is read: the store is opened read-only per request (SQLite WAL lets a reader see
every committed write), a half-written last line of metrics.jsonl is skipped, and a run directory replaced by
`lightning run --overwrite` is simply opened afresh on the next request.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_sdk import credit as credit_mod
from lightning_sdk.errors import CaptureError
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import messages
from lightning_sdk.tracing.records import COMPLETION_IDS, PROMPT_IDS, REWARD_NAME, REWARD_SPAN, REWARD_VALUE, SpanRecord
from lightning_sdk.train.checkpoint import (STATE, checkpoint_name, completed_iterations, latest_checkpoint,
                                            trained_into)
from lightning_sdk.transitions import is_llm_call, to_transitions

STORE_FILE = "store.sqlite"
METRICS_FILE = "metrics.jsonl"
STATUSES = ("running", "succeeded", "failed", "abandoned", "untrained")
MAX_PAGE = 500


class RunNotFound(LookupError):
    """The asked-for run is not a run under the dashboard's root."""


@dataclass(frozen=True)
class CreditSettings:
    """How the dashboard credits a rollout's reward to its calls: the run's rule, as `lightning.toml` names it."""

    rule: str = "lightning_rl"
    components: tuple[str, ...] = ()
    error_reward: float = -1.0
    source: str = "default (pass --config to use a run's own rollout.credit)"


def is_run(path: Path) -> bool:
    return (path / STORE_FILE).is_file() or (path / METRICS_FILE).is_file() or (path / "checkpoints").is_dir()


def discover(root: Path, depth: int = 2) -> list[Path]:
    """`root` itself if it is a run, and the runs in its subdirectories (two levels: runs/<name>, <project>/runs)."""
    found = [root] if is_run(root) else []
    if depth > 0:
        try:
            children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            children = []
        for child in children:
            if child.name in ("checkpoints", "tensorboard") and is_run(root):
                continue
            found += discover(child, depth - 1)
    return found


class RunReader:
    """All runs under one root; every method takes a run's id (its path relative to the root, '.' for the root)."""

    def __init__(self, root: Path, credit: CreditSettings = CreditSettings()):
        self.root = Path(root).resolve()
        self.credit = credit
        self._rule = credit_mod.resolve(credit.rule)  # ValueError naming rollout.credit: bad input, at start

    # ------------------------------------------------------------------------------------------------ runs

    def run_dir(self, run_id: str) -> Path:
        path = (self.root / run_id).resolve()
        if not path.is_relative_to(self.root) or not is_run(path):
            raise RunNotFound(f"no run {run_id!r} under {self.root}")
        return path

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for path in discover(self.root):
            history = _history(path)
            counts = self._with_store(path, Store.status_counts, {})
            out.append({
                "id": path.relative_to(self.root).as_posix() or ".",
                "path": str(path),
                "iterations": len(history),
                "last_reward": history[-1].get("reward_mean") if history else None,
                "rollouts": sum(counts.values()),
                "running": counts.get("running", 0),
                "failed": counts.get("failed", 0) + counts.get("abandoned", 0),
                "modified": max((p.stat().st_mtime for p in (path / STORE_FILE, path / METRICS_FILE) if p.exists()),
                                default=None),
            })
        return out

    def summary(self, run_id: str) -> dict[str, Any]:
        """The iteration table (metrics.jsonl, else the latest checkpoint's state.json) and the eval scores."""
        path = self.run_dir(run_id)
        state = _state(path)
        history = _history(path) or state.get("history", [])
        evals = self._with_store(path, _evals, [])
        if not any(e["iteration"] == 0 for e in evals) and state.get("baseline_eval") is not None:
            evals.insert(0, {"iteration": 0, "label": "before training", "mean": state["baseline_eval"],
                             "finished": None, "running": 0})
        return {
            "id": run_id, "path": str(path), "evals": evals,
            # the checkpoint each iteration's update made: the page lists the rollouts it trained on
            "history": [{**h, "checkpoint": checkpoint_name(h["iteration"]) if isinstance(h.get("iteration"), int)
                         else None} for h in history],
            "counts": self._with_store(path, Store.status_counts, {}),
            "components": self._with_store(path, Store.components, []),
            "credit": asdict(self.credit),
        }

    # -------------------------------------------------------------------------------------------- rollouts

    def rollouts(self, run_id: str, *, status: str | None = None, phase: str | None = None,
                 component: str | None = None, min_reward: float | None = None, max_reward: float | None = None,
                 iteration: int | None = None, offset: int = 0, limit: int = 50) -> dict[str, Any]:
        """One page of rollouts, newest first, with the filters applied in SQL (a big store is never loaded whole)."""
        path = self.run_dir(run_id)
        limit = max(1, min(int(limit), MAX_PAGE))
        completed = completed_iterations(path)

        def query(store: Store) -> dict[str, Any]:
            total, records = store.rollout_page(status=status, phase=phase, iteration=iteration, min_reward=min_reward,
                                                max_reward=max_reward, component=component, limit=limit,
                                                offset=offset)
            calls = store.span_counts([r.rollout_id for r in records])
            return {"total": total, "offset": offset, "limit": limit, "rows": [
                {"rollout_id": r.rollout_id, "phase": r.phase, "iteration": r.iteration, "status": r.status,
                 "reward": r.reward, "calls": calls.get(r.rollout_id, (0, 0))[0],
                 "spans": calls.get(r.rollout_id, (0, 0))[1], "seconds": r.seconds,
                 "model": r.model, "task_id": r.task_id, "error": r.error,
                 "checkpoint": trained_into(r.phase, r.iteration, r.status, completed)} for r in records]}

        return self._with_store(path, query, {"total": 0, "offset": offset, "limit": limit, "rows": []})

    def rollout(self, run_id: str, rollout_id: str) -> dict[str, Any] | None:
        """One rollout as a timeline: every span in start order, LLM calls with their messages, tokens, latency
        and the reward the run's credit rule gives them."""
        path = self.run_dir(run_id)

        def query(store: Store):
            record = store.rollout(rollout_id)
            if record is None:
                return None
            return record, store.spans(rollout_id), store.task(record.task_id)

        found = self._with_store(path, query, None)
        if found is None:
            return None
        record, spans, task = found
        credited, note = self._credit(record, spans)
        # Times from the rollout's start, so that what came before the first call shows too.
        t0 = min([int(record.started_at * 1e9), *(s.start_ns for s in spans)])
        return {
            "rollout": {**asdict(record), "seconds": record.seconds},
            "task": task,
            "credit": {**asdict(self.credit), "note": note},
            "spans": [_span_view(s, t0, credited.get(s.span_id)) for s in spans],
        }

    def _credit(self, record, spans: list[SpanRecord]) -> tuple[dict[str, float], str]:
        if record.reward is None:
            return {}, "no reward yet: nothing credited"
        try:
            ts = to_transitions(record, spans, credit=self._rule, components=self.credit.components,
                                error_reward=self.credit.error_reward)
        except (CaptureError, ValueError) as e:
            return {}, f"not a training rollout: {e}"
        return {t.span_id: t.reward for t in ts}, f"{len(ts)} call(s) credited"

    @staticmethod
    def _with_store(path: Path, fn, empty):
        db = path / STORE_FILE
        if not db.is_file():
            return empty
        try:
            store = Store(db, read_only=True)
        except sqlite3.OperationalError:
            return empty
        try:
            return fn(store)
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):  # a run that has just created its file, not yet its schema
                return empty
            raise
        finally:
            store.close()


# ------------------------------------------------------------------------------------------------- helpers

def _history(path: Path) -> list[dict[str, Any]]:
    try:
        lines = (path / METRICS_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # the line a running run is writing right now
            continue
        if row.get("phase") != "eval":  # eval scores come from the store's eval rollouts (see _evals)
            out.append(row)
    return out


def _state(path: Path) -> dict[str, Any]:
    checkpoint = latest_checkpoint(path)
    if checkpoint is None:
        return {}
    try:
        return json.loads((checkpoint / STATE).read_text())
    except (OSError, ValueError):
        return {}


def _evals(store: Store) -> list[dict[str, Any]]:
    # The runtime scores eval tasks at iteration 0 before training and at run.iterations after it.
    return [{**r, "label": "before training" if r["iteration"] == 0 else f"after {r['iteration']} iterations"}
            for r in store.eval_scores()]


def _kind(span: SpanRecord) -> str:
    if span.name == REWARD_SPAN:
        return "reward"
    if is_llm_call(span):
        return "llm"
    if span.attributes.get("gen_ai.operation.name") == "execute_tool" or "tool" in span.name.lower():
        return "tool"
    return "span"


_SHOWN = {"gen_ai.input.messages", "gen_ai.output.messages", PROMPT_IDS, COMPLETION_IDS,
          "lightning.llm.completion_logprobs", "lightning.rollout.id", "lightning.rollout.attempt",
          "lightning.component"}


def _span_view(s: SpanRecord, t0: int, credited: float | None) -> dict[str, Any]:
    a = s.attributes
    kind = _kind(s)
    view: dict[str, Any] = {
        "span_id": s.span_id, "parent_id": s.parent_id, "name": s.name, "kind": kind, "component": s.component,
        "attempt": s.attempt, "status": s.status, "status_message": s.status_message,
        "start_ms": (s.start_ns - t0) / 1e6, "duration_ms": (s.end_ns - s.start_ns) / 1e6,
        "events": s.events,
        # everything not shown in its own place, as strings the page prints verbatim
        "attributes": {k: v for k, v in a.items() if k not in _SHOWN and not k.startswith(("gen_ai.prompt.",
                                                                                         "gen_ai.completion."))},
    }
    if kind == "llm":
        view.update({
            "input": messages(a, "input"), "output": messages(a, "output"),
            "prompt_tokens": len(a[PROMPT_IDS]) if PROMPT_IDS in a else a.get("gen_ai.usage.input_tokens"),
            "completion_tokens": (len(a[COMPLETION_IDS]) if COMPLETION_IDS in a
                                  else a.get("gen_ai.usage.output_tokens")),
            "model": a.get("gen_ai.response.model") or a.get("gen_ai.request.model"),
            "credited_reward": credited,
        })
    elif kind == "reward":
        view.update({"reward_name": a.get(REWARD_NAME), "reward_value": a.get(REWARD_VALUE)})
    return view


__all__ = ["CreditSettings", "RunNotFound", "RunReader", "discover", "is_run", "messages"]
