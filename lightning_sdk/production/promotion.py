"""The gate wired: a candidate adapter from the learner and the serving adapter are scored on data.eval's tasks by
the eval machinery, both in one session with the same seeds (runtime.evaluation.paired), `gate.decide` compares the
paired scores, `gate.record` keeps the decision with its evidence, and only a promoted candidate is hot-loaded into
the serving backend and routed to.

Each decision draws new seeds (evals.draw_seed of its number) and scores the serving adapter again: the score an
adapter was promoted with is the best the gate saw, biased up by that selection, so comparing later candidates
against it would reject candidates that are as good or slightly better.

With learn.canary_share, a candidate past the gate is loaded and serves that share of new episodes first
(production.canary); `check_canary` promotes it to all traffic or rolls it back by live reward.

A restart serves what was promoted last (the `promotions` and `canaries` tables name it, `learn_updates` says where
it is), and resumes a canary left undecided.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Callable

from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.production import canary, gate, live_reward
from lightning_sdk.production.learner import Update
from lightning_sdk.servers import InferenceServer
from lightning_sdk.store import connect_tables
from lightning_sdk.train.checkpoint import ADAPTER

# An adapter to score: its PEFT directory (None: the base model) and its version.
Side = tuple[Path | None, int]
# (candidate, serving, draw) -> each one's score per eval task, in task order, both sampled with the draw's seeds.
Scorer = Callable[[Side, Side, int], tuple[list[float], list[float]]]


def eval_scorer(cfg, server: InferenceServer | None = None) -> Scorer:
    """data.eval's tasks scored through the user's agent and reward, as `lightning eval` scores them, both sides in
    one session; the tasks are read now (data.DatasetError if they cannot be).

    `server`: the backend that serves the app. The session borrows it (servers.lent): both sides are LoRA adapters
    loaded into it beside the serving one and unloaded after, so a decision needs no second copy of the model (on
    one GPU there is no room for one). Without it (or with run.runtime = "ray", which places its own servers) each
    decision's session starts a backend of its own."""
    from lightning_sdk import credit, data
    from lightning_sdk.evals import draw_seed
    from lightning_sdk.runtime.evaluation import paired
    from lightning_sdk.servers.lent import LentServer

    tasks = data.load(cfg.data.eval, cfg.data.required_fields)
    rule = credit.resolve(cfg.rollout.credit)
    shared = server is not None and cfg.run.runtime != "ray"

    def scorer(candidate: Side, serving: Side, draw: int) -> tuple[list[float], list[float]]:
        ours, theirs = paired(cfg, rule, tasks, [candidate, serving], draw_seed(cfg.run.seed, draw),
                              server=LentServer(server) if shared else None)
        return ours, theirs

    return scorer


def kept_adapter(path: str | Path, name: str) -> tuple[str, Path, int] | None:
    """An update's served name, PEFT directory and version, from `learn_updates`."""
    db = sqlite3.connect(path, timeout=30)
    try:
        row = db.execute("SELECT checkpoint, version FROM learn_updates WHERE adapter=?", (name,)).fetchone()
    finally:
        db.close()
    return (name, Path(row[0]) / ADAPTER, row[1]) if row else None


def last_promoted(path: str | Path) -> tuple[str, Path, int] | None:
    """The adapter promoted last to all traffic (its served name, PEFT directory and version), if any: with a canary,
    a gate pass promotes only once its canary was promoted."""
    canaries = {c["candidate"]: c for c in canary.history(path)}
    promoted = [d.candidate for d in gate.decisions(path) if d.promoted and
                (d.candidate not in canaries or canaries[d.candidate]["promoted"])]
    return kept_adapter(path, promoted[-1]) if promoted else None


def passed_to_canary(path: str | Path, decision: gate.Decision, share: float) -> canary.Running:
    """The gate's pass and the canary it starts, stored in one transaction: both rows or neither."""
    db = connect_tables(path, gate.SCHEMA + canary.SCHEMA)
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            gate.insert(db, decision)
            running = canary.insert(db, decision.candidate, decision.serving, share)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
    finally:
        db.close()
    return running


class Promoter:
    """Decides each candidate against the adapter the gateway serves, and promotes by hot-load."""

    def __init__(self, store_path: Path, server: InferenceServer, gateway: Gateway, scorer: Scorer, *,
                 margin: float, z: float, canary_share: float | None = None, canary_min_rewards: int = 30,
                 reward_name: str = "reward"):
        self.path, self.server, self.gateway, self.scorer = store_path, server, gateway, scorer
        self.margin, self.z = margin, z
        self.canary_share, self.canary_min_rewards = canary_share, canary_min_rewards
        self.reward_name = reward_name  # the feedback a canary is judged on (live_reward.by_adapter)
        self.canary: canary.Running | None = None
        self.canary_version = 0
        self.serving: tuple[str, Path | None, int] = (gateway.policy, None, 0)  # the base model until a promotion
        kept = last_promoted(store_path)
        if kept is not None:
            self.serve(*kept)
        left = canary.running(store_path)
        resumed = kept_adapter(store_path, left.candidate) if left is not None and \
            left.serving == self.serving[0] else None
        if resumed is not None:
            self.server.load_adapter(left.candidate, str(resumed[1]))
            self.canary, self.canary_version = left, resumed[2]
            self.gateway.canary = (left.candidate, left.share)

    def serve(self, name: str, adapter: Path, version: int) -> None:
        """The adapter into the backend, then every call routed to it (the previous one stays loaded: calls
        already routed to it finish)."""
        self.server.load_adapter(name, str(adapter))
        self.route(name, adapter, version)

    def route(self, name: str, adapter: Path | None, version: int) -> None:
        """Every call routed to a loaded adapter."""
        self.gateway.retired.add(self.gateway.policy)
        self.gateway.policy = name
        self.serving = (name, adapter, version)

    def in_service(self) -> int:
        """The newest version that serves traffic: the running canary's, else the serving adapter's (what the
        learner trains from next)."""
        return self.canary_version if self.canary is not None else self.serving[2]

    def consider(self, update: Update) -> gate.Decision:
        name, adapter, version = self.serving
        draw = len(gate.decisions(self.path))  # this decision's number: new seeds, the serving adapter scored again
        candidate, serving = self.scorer((update.adapter_path, update.version), (adapter, version), draw)
        decision = gate.decide(update.adapter, candidate, name, serving, margin=self.margin, z=self.z)
        if decision.promoted and self.canary_share is not None and self.canary is not None:
            # one canary at a time: a pass now is not served, so it is not a promotion (a restart must not serve it)
            decision = dataclasses.replace(decision, promoted=False, reason=(
                f"{decision.reason}; not served: the canary {self.canary.candidate} is still being judged"))
        if decision.promoted and self.canary_share is not None:  # none running (a pass beside one was made a no)
            self.server.load_adapter(update.adapter, str(update.adapter_path))
            # the pass and its canary in one commit: a pass recorded alone would make a restart (kill -9 between
            # two writes) serve the candidate to all traffic without its canary (last_promoted)
            self.canary = passed_to_canary(self.path, decision, self.canary_share)
            self.canary_version = update.version
            self.gateway.canary = (update.adapter, self.canary_share)
            return decision
        gate.record(self.path, decision)
        if decision.promoted:
            self.serve(update.adapter, update.adapter_path, update.version)
        return decision

    def check_canary(self) -> canary.Verdict | None:
        """The running canary's verdict once both sides have enough live rewards: promoted to all traffic, or
        rolled back (its episodes go back to the serving adapter); None while it runs or with none."""
        running = self.canary
        if running is None:
            return None
        live = live_reward.by_adapter(self.path, self.reward_name, since=running.started_at)
        verdict = canary.judge(running.candidate, live.get(running.candidate, []), running.serving,
                               live.get(running.serving, []), min_rewards=self.canary_min_rewards,
                               margin=self.margin, z=self.z)
        if verdict is None:
            return None
        canary.conclude(self.path, verdict)
        self.gateway.canary = None
        self.canary = None
        if verdict.promoted:
            self.route(*kept_adapter(self.path, running.candidate))  # loaded when its canary started
        else:
            self.gateway.retired.add(running.candidate)  # calls already routed to it finish
        return verdict

