"""Training from the served log ([learn]): each update reads the rewards that arrived since the last one, turns
the calls they score into transitions (transitions.to_transitions, from the recorded token ids and sampler
log-probs), gives each call its traffic advantage (reward_log.RewardLog, kept up to date) and takes one GRPO update
(train.trainer.GRPOTrainer, with [train]'s KL to the reference and its safeguards).

Only the samples the update read train, each (sample, call) with its own advantage: a call rewarded by its id and
as part of its episode is two transitions, each trained when its own reward is read, never with the other's. A
sample whose reward is refused (traffic_advantage.admissible) is left out, counted (skipped: reward_refused).
A version is made only where an optimizer step was taken: an update whose every step was skipped (a non-finite
gradient) makes none; its rewards are consumed with the reason, and the trainer resumes from the last commit.
The evidence stored is strict JSON: a non-finite metric is stored as null and named in its `nonfinite` list.

Versions: update n makes adapter version n (the base model is version 0) from its parent, the version the trainer
stood at: the newest version in service (serving, or serving a canary), which the schedule sets (`follow`). So a
candidate the gate rejects (or whose canary is rolled back) is never trained on: the next update starts again from
what serves. The versions form a tree (each update's parent is in its evidence); a call served by version v is as
many updates old as the path from v to the parent is long (v's ancestors: parent's depth - v's depth), more than
learn.max_versions_behind and it is left out, counted (pipeline.split_stale, as pipelined training does). The
calls kept came from the parent or other versions, so the importance weight against their sampler log-probs is
always on ('auto' = AUTO_IS_CAP).

Restart: update n's trainer checkpoint (adapter, optimizer, schedule, RNG) is written first, then one SQLite
transaction records the update and every feedback id it read. A kill before the commit leaves the rewards unread
(the next start redoes update n from checkpoint n - 1, and the uncommitted checkpoint is replaced); after it, no
reward is read twice. No update is repeated and none lost.

One GPU shared in time (production.gpu_turn, with a server that sleeps): each update's trainer is made, steps and
saves inside the turn (the server asleep), then leaves the GPU (`release`); the next update reloads it from its
parent's checkpoint, as a restart does.

Failures: an update that raises drops the in-memory trainer (the next try resumes from the last committed
checkpoint) and its rewards stay unread. After learn.max_update_failures in a row, the rewards it read are
quarantined: consumed with no version and the error as their `reason` (counted in `quarantined`), so one batch
that can never train does not stall learning.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from lightning_sdk import credit, models
from lightning_sdk.config import AUTO_IS_CAP, Config
from lightning_sdk.pipeline import split_stale
from lightning_sdk.placement import trainer_device
from lightning_sdk.production.gpu_turn import Turn
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.production.reward_log import RewardLog
from lightning_sdk.store import RolloutRecord, Store
from lightning_sdk.train.checkpoint import ADAPTER
from lightning_sdk.tracing.records import GATEWAY
from lightning_sdk.transitions import Transition, to_transitions

SCHEMA = """
CREATE TABLE IF NOT EXISTS learn_updates (
    version     INTEGER PRIMARY KEY,  -- update n makes adapter version n (the base model is 0)
    made_at     REAL NOT NULL,
    adapter     TEXT NOT NULL,        -- the name it is served under once promoted
    checkpoint  TEXT NOT NULL,        -- its trainer checkpoint (adapter/ inside is what the backend loads)
    evidence    TEXT NOT NULL         -- what it read and left out, and the trainer's metrics, as JSON
);
"""  # learn_consumed (which rewards an update read) is the ledger's: its unread count is one query


@dataclass(frozen=True)
class Update:
    """What one pass over the new rewards did: `version` None when nothing could train (no adapter made)."""

    version: int | None
    adapter: str | None
    adapter_path: Path | None  # the PEFT adapter the backend hot-loads
    rewards: int  # feedback rows read
    calls: int  # transitions trained on
    stale: int  # calls left out: served by an adapter more than K updates old
    no_baseline: int  # calls left out: their sample had no baseline yet (a component's first)
    skipped: dict[str, int]  # calls left out by to_transitions or for a refused reward (reward_refused), by reason
    metrics: dict[str, float]
    quarantined: int = 0  # rewards set aside untrained after learn.max_update_failures failures in a row
    reason: str | None = None  # why they were; or why an update that trained made no version


def strict_json(evidence: dict) -> str:
    """`evidence` as strict JSON (SQLite's json functions and every parser read it): each float that is not finite is
    stored as null, and its path (e.g. "metrics.loss") listed under "nonfinite"."""
    named: list[str] = []

    def clean(v, path: str):
        if isinstance(v, float) and not math.isfinite(v):
            named.append(path)
            return None
        if isinstance(v, dict):
            return {k: clean(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return v

    out = clean(evidence, "")
    if named:
        out["nonfinite"] = named
    return json.dumps(out, allow_nan=False)


def sampling_cap(cfg: Config) -> float | None:
    """train.importance_sampling_cap for traffic: 'auto' is always on, since every sample is off-policy."""
    cap = cfg.train.importance_sampling_cap
    return AUTO_IS_CAP if cap == "auto" else cap


class Learner:
    """The update side of [learn] over a serve directory's store; one update at a time (`update`)."""

    def __init__(self, cfg: Config, directory: Path, store: Store, ledger: FeedbackLedger, base: str,
                 turn: Turn | None = None, gpus: tuple[int, ...] = ()):
        if cfg.learn is None:
            raise ValueError("Learner: the config has no [learn] section")
        self.cfg, self.learn, self.store, self.ledger, self.base = cfg, cfg.learn, store, ledger, base
        self.folder = directory / "learn"
        self.rule = credit.resolve(cfg.rollout.credit)
        # One GPU shared in time (production.gpu_turn): the update runs in the turn (the server asleep), and the
        # trainer leaves the GPU after it (`release`). None: the trainer stays resident, the server awake.
        self.turn = turn
        self.gpus = gpus  # the placement's train GPUs: the trainer takes the first (one process; () = train.device)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(store.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.executescript(SCHEMA)
        self.version = self._db.execute("SELECT COALESCE(MAX(version), 0) AS v FROM learn_updates").fetchone()["v"]
        self.parent = self.version  # what the next update starts from, until the schedule says what serves
        self._last = time.monotonic()
        self._through = ledger.consumed_through(self.learn.reward_name)  # every reward up to this seq is consumed
        self.failed = 0  # updates that raised in a row
        self.quarantined = 0  # rewards quarantined since start
        self._trainer = None
        self._making = threading.Lock()
        # the rewarded samples and their advantages, taken in as they arrive (built from the whole log on first use)
        self.rewards = RewardLog(store, self.rule, self.learn.reward_name, self.learn.alpha)
        self._spans_read = 0  # spans transitions() decoded for the rewards it was given

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self.rewards.close()

    def adapter_name(self, version: int) -> str:
        return f"{self.cfg.run.name}-serve-v{version}"

    @property
    def spans_read(self) -> int:
        """Spans decoded from the store since start, by the updates' reads and the view of the log: what reading
        the log has cost (it grows with what arrived, not with the log's size)."""
        return self._spans_read + self.rewards.spans_read

    def checkpoint(self, version: int) -> Path:
        return self.folder / f"v{version:06d}"

    def updates(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._db.execute("SELECT * FROM learn_updates ORDER BY version")]

    def pending(self) -> list[sqlite3.Row]:
        """The rewards (learn.reward_name) no update has read yet, in the order they arrived."""
        return self.ledger.unread(self.learn.reward_name, self._through)

    def due(self) -> bool:
        n = self.ledger.unread_count(self.learn.reward_name, self._through)
        waited = self.learn.every_minutes is not None and time.monotonic() - self._last >= self.learn.every_minutes * 60
        return n >= self.learn.every_rewarded or (n > 0 and waited)

    def follow(self, version: int) -> None:
        """The next update starts from `version` (the newest in service): after a rejection or a rollback, the
        candidate it had trained is dropped and the trainer resumes from that version's checkpoint (the base model:
        a new trainer)."""
        with self._making:
            if version != self.parent:
                self.parent, self._trainer = version, None

    def trainer(self):
        """The GRPO trainer, made on first use and resumed from its parent's committed update."""
        with self._making:  # made once, whichever thread asks first
            if self._trainer is None:
                from lightning_sdk.servers.select import resolved_backend
                from lightning_sdk.train.trainer import GRPOTrainer  # torch: only a serve that learns loads it

                train = self.cfg.train
                train = train.model_copy(update={"device": trainer_device(train.device, self.gpus)})
                # the backend: how records that do not say what it applied are replayed
                t = GRPOTrainer(models.resolve(self.cfg.model.name), train, seed=self.cfg.run.seed,
                                backend=resolved_backend(self.cfg))
                t.importance_sampling_cap = sampling_cap(self.cfg)
                if self.parent:
                    t.load_state(self.checkpoint(self.parent))
                self._trainer = t
        return self._trainer

    def release(self) -> None:
        """The trainer off the accelerator until the next update, which reloads it from its parent's checkpoint (as
        a restart does): with one GPU shared in time, the server wakes into the memory it held, and serving between
        updates has the whole share serve.gpu_memory_utilization gives it."""
        with self._making:
            if self._trainer is None:
                return
            self._trainer = None
        import gc

        import torch

        gc.collect()  # a PEFT model holds reference cycles: its tensors go only once these are collected
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the allocator's cached blocks back to the device, for the waking server

    def versions(self) -> tuple[dict[str, int], int]:
        """For `split_stale`: each version's adapter name -> 2 * depth(common ancestor with the parent) - its own
        depth, and the parent's depth; so the age split_stale takes (the parent's depth minus that) is the number of
        updates between the two in the tree of versions (an ancestor: the difference of their depths; a sibling:
        up to their common ancestor and down again)."""
        up, depth = {0: 0}, {0: 0}
        for row in self.updates():  # in version order: a parent is always made before its children
            v = row["version"]
            up[v] = json.loads(row["evidence"]).get("parent", v - 1)
            depth[v] = depth[up[v]] + 1
        line, v = {0}, self.parent  # the parent and its ancestors
        while v:
            line.add(v)
            v = up[v]

        def common(v: int) -> int:
            while v not in line:
                v = up[v]
            return v

        return ({self.base if v == 0 else self.adapter_name(v): 2 * depth[common(v)] - depth[v] for v in depth},
                depth[self.parent])

    def transitions(self, rows: list[sqlite3.Row]) -> tuple[list[Transition], dict[tuple[str, str], float], int,
                                                           Counter]:
        """The calls of the samples the rewards `rows` score, as transitions (each one's rollout_id is its sample:
        the episode's rollout id, or the call's span id), with their advantages by (sample, call); and how many calls
        had no baseline, and what was left out by reason (to_transitions' and reward_refused). Reads what arrived
        since the last call and the rows' own calls, not the whole log."""
        self.rewards.refresh()
        skipped: Counter = Counter()
        keys: dict[str, None] = {}  # the samples read, in order
        out: list[Transition] = []
        for r in rows:
            key = r["rollout_id"] if r["kind"] == "episode_id" else r["call_id"]
            if key in keys:
                continue
            keys[key] = None
            if r["kind"] == "episode_id":
                spans = self.store.spans(r["rollout_id"])
            else:  # one call: read by its id, never the other calls of its episode (or of none)
                one = self.store.span(key)
                spans = [one] if one is not None and one.rollout_id == (r["rollout_id"] or "") else []
            self._spans_read += len(spans)
            calls = [s for s in spans if s.source == GATEWAY]
            if not calls:
                continue
            if self.rewards.refused([key]):
                skipped["reward_refused"] += len(calls)
                continue
            sample = RolloutRecord(rollout_id=key, task_id="", group_id=key, iteration=0, phase="serve", attempt=0,
                                   model=None, status="succeeded", output=None, reward=0.0, error=None,
                                   traceback=None, started_at=0.0, ended_at=None)
            out += to_transitions(sample, spans, credit=self.rule, skipped=skipped)
        adv = self.rewards.advantages(keys)
        kept = [t for t in out if (t.rollout_id, t.span_id) in adv]
        return kept, adv, len(out) - len(kept), skipped

    def update(self) -> Update:
        """Read every pending reward; train one update on what it scores, if anything can train; commit. One that
        raises is raised again, until the learn.max_update_failures-th in a row, which quarantines its rewards."""
        rows = self.pending()
        self._last = time.monotonic()
        try:
            update = self._train(rows)
        except Exception as e:
            self._trainer = None  # it may have stepped past the last commit: the next try resumes from that
            self.failed += 1
            if self.failed < self.learn.max_update_failures:
                raise
            reason = f"update failed {self.failed} times in a row: {type(e).__name__}: {str(e)[:300]}"
            self._commit(rows, None, None, reason)  # consumed untrained, each with the reason
            self.failed = 0
            self.quarantined += len(rows)
            return Update(None, None, None, len(rows), 0, 0, 0, {}, {}, quarantined=len(rows), reason=reason)
        self.failed = 0
        return update

    def _commit(self, rows: list[sqlite3.Row], made: int | None, evidence: dict | None,
                reason: str | None = None) -> None:
        """One transaction: update `made` (if any) and every reward in `rows` consumed by it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if made is not None:
                    self._db.execute("INSERT INTO learn_updates VALUES (?, ?, ?, ?, ?)",
                                     (made, time.time(), self.adapter_name(made), str(self.checkpoint(made)),
                                      strict_json(evidence)))
                self._db.executemany("INSERT INTO learn_consumed (feedback_id, version, reason) VALUES (?, ?, ?)",
                                     [(r["feedback_id"], made, reason) for r in rows])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        if rows:
            self._through = max(self._through, max(r["seq"] for r in rows))

    def _train(self, rows: list[sqlite3.Row]) -> Update:
        ts, adv, no_baseline, skipped = self.transitions(rows)
        versions, depth = self.versions()
        kept, age = split_stale(ts, versions, depth, self.learn.max_versions_behind)
        metrics: dict[str, float] = {}
        made = reason = None
        if kept:
            turn: dict[str, float] = {}
            with self.turn(turn) if self.turn is not None else nullcontext():
                try:
                    trainer = self.trainer()  # made (or reloaded) and stepped while the GPU is the trainer's
                    before = trainer.global_step
                    metrics = trainer.step(kept, advantages=[adv[(t.rollout_id, t.span_id)] for t in kept])
                    if trainer.global_step > before and metrics.get("skipped_steps", 0.0) >= self.cfg.train.epochs:
                        # no optimizer step taken, yet the trainer counted one (and moved its schedule): drop it,
                        # so the next update resumes from the last commit, and make no version
                        self._trainer = None
                        reason = (f"no optimizer step taken: every gradient was non-finite "
                                  f"(train.skipped_steps = {metrics['skipped_steps']:g})")
                    elif trainer.global_step > before:
                        made = self.version + 1
                        trainer.save_state(self.checkpoint(made))  # before the commit: see the module docstring
                finally:  # also after a failed step (out of memory, say): the server wakes into this memory
                    if self.turn is not None:
                        self.release()
            metrics.update(turn)
        metrics.update(age.metrics())
        evidence = {"rewards": len(rows), "calls": len(kept) if made else 0, "stale": age.dropped,
                    "no_baseline": no_baseline, "skipped": dict(skipped), "metrics": metrics, "parent": self.parent}
        self._commit(rows, made, evidence, reason)
        if made is not None:
            self.version = self.parent = made
        return Update(made, self.adapter_name(made) if made else None,
                      self.checkpoint(made) / ADAPTER if made else None, len(rows), evidence["calls"],
                      age.dropped, no_baseline, dict(skipped), metrics, reason=reason)
