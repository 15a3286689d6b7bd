"""Reading run directories for the dashboard, read-only: the runs under a root, a run's iterations and evals,
its rollouts (filtered, one page at a time) and one rollout as a timeline; the rollouts of the run's store, or of
one of the stores its `lightning eval`s kept in evals/ (sealed: read-only readers leave no file beside them).

A run may be writing while it is read: the store is opened read-only per request (SQLite WAL lets a reader see
every committed write), a half-written last line of metrics.jsonl is skipped, and a run directory replaced by
`lightning run --overwrite` is simply opened afresh on the next request.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_sdk import config as config_mod
from lightning_sdk import credit as credit_mod
from lightning_sdk import metric_names as names
from lightning_sdk.constraint import Constraint
from lightning_sdk.dashboard.explain import Scoring, explain, view
from lightning_sdk.dashboard.versions import SERVE_FILE, timeline
from lightning_sdk.errors import CaptureError
from lightning_sdk.evals import EVALS_DIR, score_words, split_of
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import messages
from lightning_sdk.tracing.records import (COMPLETION_IDS, COMPLETION_LOGPROBS, COMPLETION_TOKENS, CONSTRAINT,
                                           PROMPT_IDS, REWARD_NAME, REWARD_SPAN, REWARD_VALUE, SpanRecord)
from lightning_sdk.train.checkpoint import (STATE, checkpoint_name, completed_iterations, latest_checkpoint,
                                            trained_into)
from lightning_sdk.transitions import is_llm_call, to_transitions

STORE_FILE = "store.sqlite"
METRICS_FILE = "metrics.jsonl"
STATUSES = ("running", "succeeded", "failed", "abandoned", "untrained")
MAX_PAGE = 500
PREVIEW = 160  # characters of a task or an output in the rollout list
# a task's expected answer, under the names datasets use (the cookbook's: answer, result, gold)
ANSWER_FIELDS = ("answer", "result", "expected", "expected_answer", "gold", "target", "solution", "label")
QUESTION_FIELDS = ("question", "prompt", "input", "query", "problem", "instruction", "text")
CONFIG_TOML = "lightning.toml"


class RunNotFound(LookupError):
    """The asked-for run is not a run under the dashboard's root."""


@dataclass(frozen=True)
class CreditSettings:
    """How the dashboard credits a rollout's reward to its calls: the run's rule, as `lightning.toml` names it."""

    rule: str = "lightning_rl"
    components: tuple[str, ...] = ()
    error_reward: float = -1.0
    scale: str = "group"  # train.scale_rewards
    failed_reward: float | None = None  # rollout.failed_reward
    drop_zero_variance: bool = False  # train.drop_zero_variance_groups
    source: str = "the defaults (no config.json in the run, no lightning.toml beside it, no --config)"


def is_run(path: Path) -> bool:
    """A run directory, or a `lightning serve --dir` (its serve.sqlite: its versions are shown)."""
    return any((path / f).is_file() for f in (STORE_FILE, METRICS_FILE, SERVE_FILE)) or (path / "checkpoints").is_dir()


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

    def __init__(self, root: Path, credit: CreditSettings = CreditSettings(), reward_name: str = "reward"):
        self.root = Path(root).resolve()
        self.credit = credit
        self.reward_name = reward_name  # a serve directory's live reward: learn.reward_name of --config
        self._rule = credit_mod.resolve(credit.rule)  # ValueError naming rollout.credit: bad input, at start

    # ------------------------------------------------------------------------------------------------ runs

    def config(self, path: Path) -> tuple[dict[str, Any] | None, str | None]:
        """The run's effective config and where it was read: its config.json (`lightning run` writes it), else a
        lightning.toml beside the run whose run.dir is this run, loaded with its defaults."""
        try:
            text = (path / config_mod.RUN_CONFIG_FILE).read_text()
            return json.loads(text), f"{config_mod.RUN_CONFIG_FILE} in the run"
        except FileNotFoundError:
            pass
        except (OSError, ValueError):  # being written (it is written whole, by a rename) or damaged
            return None, None
        for folder in (path.parent, path.parent.parent):
            toml = folder / CONFIG_TOML
            if not toml.is_file():
                continue
            try:
                cfg = config_mod.load(toml)
            except config_mod.ConfigError:
                continue
            if cfg.run.dir is not None and Path(cfg.run.dir).resolve() == path:
                return config_mod.effective(cfg), str(toml)
        return None, None

    def scoring(self, path: Path) -> tuple[CreditSettings, Scoring]:
        """The credit settings a run's rollouts are credited with: the run's own config when it has one (a custom
        rule only with --config: the dashboard does not import code named in a run directory), else --config's."""
        cfg, source = self.config(path)
        settings, rule = self.credit, self._rule
        if cfg is not None:
            r, train = cfg.get("rollout", {}), cfg.get("train", {})
            name = r.get("credit", "lightning_rl")
            if name in credit_mod.BUILTIN or name == self.credit.rule:
                pols = cfg.get("policies") or {}
                components = [c for p in pols.values() for c in p.get("components", [])] if pols else r.get(
                    "components", [])
                failed = r.get("failed_reward")
                settings = CreditSettings(rule=name, components=tuple(components),
                                          error_reward=float(r.get("error_reward", -1.0)),
                                          scale=str(train.get("scale_rewards", "group")),
                                          failed_reward=None if failed is None else float(failed),
                                          drop_zero_variance=bool(train.get("drop_zero_variance_groups", False)),
                                          source=str(source))
                rule = credit_mod.resolve(name) if name in credit_mod.BUILTIN else self._rule
        return settings, Scoring(rule, settings.rule, settings.components, settings.error_reward, settings.scale,
                                 settings.failed_reward, settings.drop_zero_variance)

    def run_dir(self, run_id: str) -> Path:
        path = (self.root / run_id).resolve()
        if not path.is_relative_to(self.root) or not is_run(path):
            raise RunNotFound(f"no run {run_id!r} under {self.root}")
        return path

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for path in discover(self.root):
            history, logged = _metrics(path)
            counts = self._with_store(path, Store.status_counts, {})
            out.append({
                "id": path.relative_to(self.root).as_posix() or ".",
                "path": str(path),
                "iterations": len(history),
                "last_reward": history[-1].get(names.REWARD_MEAN) if history else None,
                "eval": ([None] + _evals([], logged))[-1],  # the last eval pass metrics.jsonl logged
                "rollouts": sum(counts.values()),
                "running": counts.get("running", 0),
                "failed": counts.get("failed", 0) + counts.get("abandoned", 0),
                "modified": max((p.stat().st_mtime for p in (path / STORE_FILE, path / METRICS_FILE) if p.exists()),
                                default=None),
                "outcome": outcome(path),
                "serve": (path / SERVE_FILE).is_file(),
            })
        return out

    def summary(self, run_id: str) -> dict[str, Any]:
        """The iteration table (metrics.jsonl, else the latest checkpoint's state.json) and the eval scores."""
        path = self.run_dir(run_id)
        state = _state(path)
        history, logged = _metrics(path)
        history = history or [names.current_row(h) for h in state.get("history", [])]
        evals = _evals(self._with_store(path, Store.eval_scores, []), logged)
        cfg, config_source = self.config(path)
        settings, _ = self.scoring(path)
        if not any(e["iteration"] == 0 for e in evals) and state.get("baseline_eval") is not None:
            evals.insert(0, {"iteration": 0, "label": "before training", "mean": state["baseline_eval"],
                             "stderr": state.get("baseline_eval_stderr"), "tasks": None, "finished": None,
                             "running": 0, "words": score_words(None)})
        return {
            "id": run_id, "path": str(path), "evals": evals, "eval_stores": self.eval_stores(path),
            # the checkpoint each iteration's update made: the page lists the rollouts it trained on
            "history": [{**h, "checkpoint": checkpoint_name(h["iteration"]) if isinstance(h.get("iteration"), int)
                         else None} for h in history],
            "counts": self._with_store(path, Store.status_counts, {}),
            # each logged key's chart section (the groups TensorBoard shows it in)
            "sections": {k: names.group(k) for h in history for k in h},
            "outcome": outcome(path),
            # the training rewards' range: the std band cannot leave it (0/1 rewards keep it within 0 and 1)
            "reward_range": self._with_store(path, Store.reward_range, None),
            "components": self._with_store(path, Store.components, []),
            "credit": asdict(settings),
            "config": config_mod.flatten(cfg) if cfg is not None else None, "config_source": config_source,
            # with [policies], their names: each one's curves (rollout/transitions/<name>, train/<name>/<key>) go
            # together
            "policies": sorted((cfg or {}).get("policies") or {}) or sorted(
                {k.removeprefix(names.policy_transitions("")) for h in history for k in h
                 if k.startswith(names.policy_transitions(""))}),
            # a `lightning serve --dir`: its versions in order, with the gate's and canary's numbers and live reward
            "serve": timeline(path / SERVE_FILE, self.reward_name) if (path / SERVE_FILE).is_file() else None,
        }

    # -------------------------------------------------------------------------------------------- rollouts

    def rollouts(self, run_id: str, *, status: str | None = None, phase: str | None = None,
                 component: str | None = None, min_reward: float | None = None, max_reward: float | None = None,
                 iteration: int | None = None, search: str | None = None, sort: str = "started",
                 descending: bool = True, offset: int = 0, limit: int = 50,
                 store: str | None = None) -> dict[str, Any]:
        """One page of rollouts (newest first, or by `sort`), with the filters and the text search applied in SQL (a
        big store is never loaded whole); each row previews its task and its output. `store`: one of the run's
        evals/ files by name (see store_file), else the run's own store."""
        path = self.run_dir(run_id)
        db = self.store_file(path, store)
        limit = max(1, min(int(limit), MAX_PAGE))
        completed = completed_iterations(path)

        def query(store: Store) -> dict[str, Any]:
            total, records = store.rollout_page(status=status, phase=phase, iteration=iteration, min_reward=min_reward,
                                                max_reward=max_reward, component=component, search=search,
                                                sort=sort, descending=descending, limit=limit, offset=offset)
            calls = store.span_counts([r.rollout_id for r in records])
            tasks = {tid: store.task(tid) for tid in {r.task_id for r in records}}
            return {"total": total, "offset": offset, "limit": limit, "rows": [
                {"rollout_id": r.rollout_id, "phase": r.phase, "iteration": r.iteration, "status": r.status,
                 "reward": r.reward, "calls": calls.get(r.rollout_id, (0, 0))[0],
                 "spans": calls.get(r.rollout_id, (0, 0))[1], "seconds": r.seconds,
                 "model": r.model, "task_id": r.task_id, "error": r.error,
                 "task_preview": preview(question(tasks.get(r.task_id))), "output_preview": preview(r.output),
                 "checkpoint": trained_into(r.phase, r.iteration, r.status, completed)} for r in records]}

        return self._with_store(path, query, {"total": 0, "offset": offset, "limit": limit, "rows": []}, db=db)

    def rollout(self, run_id: str, rollout_id: str, store: str | None = None) -> dict[str, Any] | None:
        """One rollout as a timeline: every span in start order, LLM calls with their messages, tokens, latency
        and the reward the run's credit rule gives them. `store` as in rollouts()."""
        path = self.run_dir(run_id)
        db = self.store_file(path, store)

        settings, scoring = self.scoring(path)

        def query(store: Store):
            record = store.rollout(rollout_id)
            if record is None:
                return None
            return record, store.spans(rollout_id), store.task(record.task_id), explain(store, record, scoring)

        found = self._with_store(path, query, None, db=db)
        if found is None:
            return None
        record, spans, task, explained = found
        credited, note = self._credit(record, spans, scoring)
        # Times from the rollout's start, so that what came before the first call shows too.
        t0 = min([int(record.started_at * 1e9), *(s.start_ns for s in spans)])
        return {
            "rollout": {**asdict(record), "seconds": record.seconds},
            "task": task,
            "expected": expected(task),
            "credit": {**asdict(settings), "note": explained.note if explained else note},
            "spans": [{**_span_view(s, t0, credited.get(s.span_id)),
                       "advantage": view(explained.advantages[s.span_id], settings.rule)
                       if explained and s.span_id in explained.advantages else None} for s in spans],
            # the rollouts of its group, itself included, side by side
            "group": [{"rollout_id": g.rollout_id, "status": g.status, "reward": g.reward, "output": g.output,
                       "rollout_advantage": explained.rollout_advantage.get(g.rollout_id),
                       "self": g.rollout_id == record.rollout_id} for g in explained.group] if explained else [],
        }

    @staticmethod
    def _credit(record, spans: list[SpanRecord], s: Scoring) -> tuple[dict[str, float], str]:
        if record.reward is None:
            return {}, "no reward yet: nothing credited"
        try:
            ts = to_transitions(record, spans, credit=s.rule, components=s.components, error_reward=s.error_reward)
        except (CaptureError, ValueError) as e:
            return {}, f"not a training rollout: {e}"
        return {t.span_id: t.reward for t in ts}, f"{len(ts)} call(s) credited"

    # ------------------------------------------------------------------------------------------ eval stores

    @staticmethod
    def eval_files(path: Path) -> list[Path]:
        """The stores the run's `lightning eval`s kept (evals/<UTC time>-<policy>.sqlite), oldest first."""
        return sorted(p for p in (path / EVALS_DIR).glob("[!.]*.sqlite") if p.is_file())

    def store_file(self, path: Path, name: str | None) -> Path:
        """The store a request reads: the run's, or the evals/ file `name` names. `name` comes from the client: it is
        only ever compared with the folder's listing, never made into a path."""
        if name is None:
            return path / STORE_FILE
        for db in self.eval_files(path):
            if db.name == name:
                return db
        raise RunNotFound(f"no eval store {name!r} in {path / EVALS_DIR}")

    def eval_stores(self, path: Path) -> list[dict[str, Any]]:
        """Each evals/ store: its name, the iteration it scored, the score with its standard error and tasks, and
        what the score is in words. Trained on: every task the run has train rollouts of (an upper bound for an
        earlier checkpoint, so a score is never called held-out when it is not)."""
        files = self.eval_files(path)
        trained = self._with_store(path, lambda s: s.task_ids("train"), set()) if files else set()
        out = []
        for db in files:
            scores, ids = self._with_store(path, lambda s: (s.eval_scores(), s.task_ids("eval")), ([], set()), db=db)
            split, seen = split_of(ids, trained)
            out += [{"name": db.name, "iteration": r["iteration"], "mean": r["mean"], "stderr": r["stderr"],
                     "tasks": r["finished"], "running": r["running"], "split": split,
                     "words": score_words(split, seen, len(ids))} for r in scores]
        return out

    @staticmethod
    def _with_store(path: Path, fn, empty, db: Path | None = None):
        db = db or path / STORE_FILE
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

def expected(task: dict | None) -> dict[str, Any] | None:
    """The task's expected answer and the field it is in, when it has one."""
    for name in ANSWER_FIELDS:
        if isinstance(task, dict) and task.get(name) is not None:
            return {"field": name, "value": task[name]}
    return None


def question(task: dict | None) -> str | None:
    """What the task asks, in one string: its question-like field, else the task as JSON."""
    if not isinstance(task, dict):
        return None
    for name in QUESTION_FIELDS:
        if isinstance(task.get(name), str):
            return task[name]
    return json.dumps({k: v for k, v in task.items() if k != "id"}, default=str)


def preview(text: str | None) -> str:
    if not text:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= PREVIEW else flat[:PREVIEW - 1] + "…"


def _metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """metrics.jsonl's iteration rows, and its eval rows (one per eval pass, see _evals)."""
    try:
        lines = (path / METRICS_FILE).read_text().splitlines()
    except OSError:
        return [], []
    history, logged = [], []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # the line a running run is writing right now
            continue
        if not isinstance(row, dict):
            continue
        row = names.current_row(row)  # a run an earlier version wrote reads as today's
        if row.get("phase") != "eval":
            history.append(row)
        elif isinstance(row.get("iteration"), int):
            logged.append(row)
    return history, logged


def outcome(path: Path) -> dict[str, Any]:
    """The run's status and why it stopped (outcome.json, which `lightning run` keeps); "unknown" for a run that
    has none (an older one), "serve" for a `lightning serve` directory, "killed" for one whose process ended without
    writing how."""
    try:
        row = json.loads((path / config_mod.OUTCOME_FILE).read_text())
    except (OSError, ValueError):
        if (path / SERVE_FILE).is_file():
            return {"status": "serve", "reason": "a lightning serve directory: its versions are below"}
        return {"status": "unknown", "reason": "an older run (no outcome.json)"}
    if not isinstance(row, dict):
        return {"status": "unknown", "reason": "outcome.json is not an object"}
    status, reason = str(row.get("status", "unknown")), row.get("reason")
    if status == "running" and not _alive(row.get("pid")):
        status, reason = "killed", "its process ended without saying how (killed, or the machine stopped)"
    return {"status": status, "reason": None if reason is None else str(reason)}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _state(path: Path) -> dict[str, Any]:
    checkpoint = latest_checkpoint(path)
    if checkpoint is None:
        return {}
    try:
        return json.loads((checkpoint / STATE).read_text())
    except (OSError, ValueError):
        return {}


def _evals(live: list[dict[str, Any]], logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each eval pass of the run: the store's eval rollouts per iteration (`live`, counted as they finish), and
    once metrics.jsonl has its row (`logged`), the score the run printed, its standard error, its tasks and its
    split; a pass under way takes the split of the run's other (the same tasks are scored before and after).
    The runtime scores eval tasks at iteration 0 before training and at run.iterations after it."""
    rows = {r["iteration"]: r for r in logged}
    split = next((r[names.EVAL_SPLIT] for r in logged if r.get(names.EVAL_SPLIT)), None)  # None: before eval_split
    out = []
    for it in sorted({r["iteration"] for r in live} | set(rows)):
        e = next((r for r in live if r["iteration"] == it), None) or {"iteration": it, "finished": None, "running": 0}
        e = {"mean": None, "stderr": None, "failed": None, "failures": None, **e, "tasks": e["finished"]}
        row = rows.get(it)
        if row is not None and not e["running"]:
            e.update(mean=row.get(names.EVAL_REWARD_MEAN), stderr=row.get(names.EVAL_STDERR),
                     tasks=row.get(names.EVAL_TASKS, e["tasks"]), failed=row.get(names.EVAL_FAILED),
                     failures=row.get(names.EVAL_FAILURES))
        e["split"] = row.get(names.EVAL_SPLIT) if row is not None else split
        e["words"] = score_words(e["split"])
        e["label"] = "before training" if it == 0 else f"after {it} iterations"
        out.append(e)
    return out


def _kind(span: SpanRecord) -> str:
    if span.name == REWARD_SPAN:
        return "reward"
    if is_llm_call(span):
        return "llm"
    if span.attributes.get("gen_ai.operation.name") == "execute_tool" or "tool" in span.name.lower():
        return "tool"
    return "span"


_SHOWN = {"gen_ai.input.messages", "gen_ai.output.messages", PROMPT_IDS, COMPLETION_IDS,
          COMPLETION_LOGPROBS, COMPLETION_TOKENS, CONSTRAINT, "lightning.rollout.id", "lightning.rollout.attempt",
          "lightning.component"}


def _constraint_view(text: Any) -> dict[str, Any] | None:
    """What the call was sampled under: its name, the request's part it came from, and its definition as JSON."""
    if not isinstance(text, str):
        return None
    try:
        c = Constraint.from_json(text)
    except (ValueError, KeyError, TypeError):
        return {"label": "unreadable", "param": "", "spec": text[:2000]}
    return {"label": c.label, "param": c.param, "spec": json.dumps(c.spec, indent=2)}


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
            # per completion token: its text (when the server sent it) and the sampler's log-prob
            "completion_ids": a.get(COMPLETION_IDS), "completion_logprobs": a.get(COMPLETION_LOGPROBS),
            "completion_token_texts": a.get(COMPLETION_TOKENS),
            "constraint": _constraint_view(a.get(CONSTRAINT)),
        })
    elif kind == "reward":
        view.update({"reward_name": a.get(REWARD_NAME), "reward_value": a.get(REWARD_VALUE)})
    return view


__all__ = ["CreditSettings", "RunNotFound", "RunReader", "discover", "expected", "is_run", "messages",
           "preview", "question"]
