"""The gate wired: a candidate adapter from the learner is scored on data.eval's tasks by the eval machinery
(runtime.evaluation.evaluate: each task once, seeded per task, so the candidate and the serving adapter are scored
on the same tasks with the same seeds), `gate.decide` compares the paired scores, `gate.record` keeps the decision
with its evidence, and only a promoted candidate is hot-loaded into the serving backend and routed to.

A restart serves what was promoted last (the `promotions` table names it, `learn_updates` says where it is).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.production import gate
from lightning_sdk.production.learner import Update
from lightning_sdk.servers import InferenceServer
from lightning_sdk.train.checkpoint import ADAPTER

# (a PEFT adapter directory or None for the base model, its version) -> one score per eval task, in task order.
Scorer = Callable[[Path | None, int], list[float]]


def eval_scorer(cfg) -> Scorer:
    """data.eval's tasks scored through the user's agent and reward, as `lightning eval` scores them; the tasks are
    read now (data.DatasetError if they cannot be)."""
    from rich.console import Console

    from lightning_sdk import credit, data
    from lightning_sdk.runtime.evaluation import evaluate

    tasks = data.load(cfg.data.eval, cfg.data.required_fields)
    rule = credit.resolve(cfg.rollout.credit)
    quiet = Console(quiet=True)
    # The eval serves version n as `<run>-iter<n>` and stores its rollouts at iteration n, as `lightning eval` does.
    return lambda adapter, version: evaluate(cfg, quiet, rule, tasks, adapter, iteration=version).scores


def last_promoted(path: str | Path) -> tuple[str, Path, int] | None:
    """The adapter promoted last (its served name, PEFT directory and version), if any."""
    promoted = [d for d in gate.decisions(path) if d.promoted]
    if not promoted:
        return None
    db = sqlite3.connect(path, timeout=30)
    try:
        row = db.execute("SELECT checkpoint, version FROM learn_updates WHERE adapter=?",
                         (promoted[-1].candidate,)).fetchone()
    finally:
        db.close()
    return (promoted[-1].candidate, Path(row[0]) / ADAPTER, row[1]) if row else None


class Promoter:
    """Decides each candidate against the adapter the gateway serves, and promotes by hot-load."""

    def __init__(self, store_path: Path, server: InferenceServer, gateway: Gateway, scorer: Scorer, *,
                 margin: float, z: float):
        self.path, self.server, self.gateway, self.scorer = store_path, server, gateway, scorer
        self.margin, self.z = margin, z
        self.serving: tuple[str, Path | None, int] = (gateway.policy, None, 0)  # the base model until a promotion
        # The serving adapter's scores on the same tasks and seeds: from its own promotion, or scored once here.
        self.serving_scores: list[float] | None = None
        kept = last_promoted(store_path)
        if kept is not None:
            self.serve(*kept)

    def serve(self, name: str, adapter: Path, version: int) -> None:
        """The adapter into the backend, then every call routed to it (the previous one stays loaded: calls
        already routed to it finish)."""
        self.server.load_adapter(name, str(adapter))
        self.gateway.retired.add(self.gateway.policy)
        self.gateway.policy = name
        self.serving = (name, adapter, version)
        self.serving_scores = None

    def consider(self, update: Update) -> gate.Decision:
        name, adapter, version = self.serving
        candidate = self.scorer(update.adapter_path, update.version)
        if self.serving_scores is None:
            self.serving_scores = self.scorer(adapter, version)
        serving = self.serving_scores
        decision = gate.decide(update.adapter, candidate, name, serving, margin=self.margin, z=self.z)
        gate.record(self.path, decision)
        if decision.promoted:
            self.serve(update.adapter, update.adapter_path, update.version)
            self.serving_scores = candidate
        return decision

