"""The loop behind `lightning run`: serve, collect, update, hot-load, checkpoint, repeat.

One iteration = a collection phase (the collector runs the agent against the inference server, spans land in the
store) and an update phase (spans -> transitions -> one GRPO update -> a new LoRA adapter, hot-loaded into the
server). With [policies] there is one adapter per policy: the gateway serves each call by its component's. Each
finished iteration is checkpointed atomically, so `--resume` continues a killed run from its last complete update
and never repeats one. Where things run is session.py (servers, collectors) and launch.py (the trainer); where a
run starts from is resume.py.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from lightning_sdk import credit, data, models
from lightning_sdk import metric_names as names
from lightning_sdk.config import Config, effective, policies
from lightning_sdk.console import print_whole, status
from lightning_sdk.errors import CaptureError, SetupError
from lightning_sdk.evals import EvalScore, split_of
from lightning_sdk.heap import frozen_heap
from lightning_sdk.metrics import MetricsLog, check_trackers
from lightning_sdk.pipeline import UpdateThread, split_stale
from lightning_sdk.rollouts.collector import Collector
from lightning_sdk.runtime.evaluation import Evaluated, evaluate, score
from lightning_sdk.runtime.feed import TaskFeed
from lightning_sdk.runtime.handover import gpu_handover
from lightning_sdk.runtime.iteration import Batch, collect_batch
from lightning_sdk.runtime.launch import count_can_refuse, place_run, share_cores, start_trainer
from lightning_sdk.runtime.preflight import preflight, say_memory
from lightning_sdk.runtime.resume import refuse_conflict, reopen, take_run_dir
from lightning_sdk.runtime.session import Session, agent_of, bind_gateway, open_session, store_session
from lightning_sdk.store import Store
from lightning_sdk.summary import iteration_table
from lightning_sdk.train.checkpoint import (TRAINER, RunState, adapter_dir, latest_checkpoint, policy_adapters,
                                           write_checkpoint)


class Runtime:
    def __init__(self, cfg: Config, *, resume: bool = False, overwrite: bool = False,
                 console: Console | None = None):
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.console = console or Console()
        self.run_dir = Path(cfg.run.dir)
        try:
            self.credit_rule = credit.resolve(cfg.rollout.credit)
        except ValueError as e:  # an unknown builtin, or a module:function that does not import
            raise SetupError(str(e)) from None
        self.session: Session | None = None  # while one is open
        self._started = 0.0  # when this process began its iterations
        self.final_eval: float | None = None
        self.final_score: EvalScore | None = None  # the trained eval, with its standard error
        self.policies = policies(cfg)
        self.multi = bool(cfg.policies)  # one adapter per policy, each call served by its component's

    @property
    def collector(self) -> Collector | None:
        """The open session's collector (its server, the gateway in front); None when none is open."""
        return self.session.collector if self.session is not None else None

    # The whole run, top to bottom.
    def run(self) -> RunState:
        with ExitStack() as stack:  # holds run.dir's lock until the run has ended
            return self._run(stack)

    def _run(self, stack: ExitStack) -> RunState:
        cfg = self.cfg
        gateway = bind_gateway(cfg, stack, self.run_dir, resume=self.resume)
        agent = agent_of(cfg)
        train_tasks = data.load(cfg.data.train, cfg.data.required_fields)
        eval_tasks = data.load(cfg.data.eval, cfg.data.required_fields) if cfg.data.eval else []
        model_path = models.resolve(cfg.model.name)  # before the run directory: bad input writes nothing
        check_trackers(cfg.run.report_to)
        # Every refusal before anything is written: GPUs that are not there, and a train.processes they cannot hold
        # (counted now where the count can refuse; otherwise after the first line, as torch loads).
        counted = count_can_refuse(cfg)
        placement, placed = place_run(cfg, counted=counted)
        preflight(cfg, self.run_dir, placement)
        checkpoint = take_run_dir(stack, self.run_dir, resume=self.resume, overwrite=self.overwrite,
                                  console=self.console)
        refuse_conflict(checkpoint, cfg, self.policies if self.multi else None)
        # Bad input has had its one line by now; the rest takes a while (the trainer's imports, the model, the
        # server), and a log that stays empty meanwhile looks like a hang.
        self.console.print(f"run {cfg.run.name!r}: {cfg.run.iterations} iterations of {cfg.model.name} in "
                           f"{cfg.run.dir}; starting the model server and the agent", highlight=False, soft_wrap=True,
                           markup=False)
        if not placement.visible and not counted:  # the built-in server on the CPU: the trainer's GPUs, counted
            placement, placed = place_run(cfg, counted=True)  # now (torch loads); no count refuses this config
        if placed:
            self.console.print(placed, highlight=False, soft_wrap=True, markup=False)
        say_memory(cfg, self.console, model_path)  # after the first line: it reads the trainer's device (torch)
        share_cores(stack, cfg)
        state = RunState.read(checkpoint) if checkpoint is not None else RunState()
        state.history = [names.current_row(row) for row in state.history]  # a run an earlier version checkpointed
        store = stack.enter_context(Store(self.run_dir / "store.sqlite"))  # closed (its WAL folded in) before the lock
        reopen(store, state, self.console)
        store.add_tasks((data.task_id(t), t) for t in train_tasks + eval_tasks)
        metrics = MetricsLog(self.run_dir, report_to=cfg.run.report_to, name=cfg.run.name,
                             config=cfg.model_dump(mode="json"))
        metrics.write_config(effective(cfg))
        eval_split = split_of(map(data.task_id, eval_tasks), map(data.task_id, train_tasks))
        baseline = (EvalScore(state.baseline_eval, state.baseline_eval_stderr, len(eval_tasks), *eval_split)
                    if state.baseline_eval is not None else None)
        metrics.rewrite(state.history, baseline_eval=baseline)
        feed = TaskFeed(train_tasks, cfg.data.tasks_per_iteration, seed=cfg.run.seed, shuffle=cfg.data.shuffle)

        metrics.write_outcome("running")
        try:
            with self._opened(agent, gateway, model_path, store, self.run_dir) as session:
                trainer = start_trainer(cfg, stack, model_path, self.policies if self.multi else None,
                                        placement.train)
                stack.enter_context(frozen_heap())  # everything started so far, for the rest of the run
                policy = {p.name: session.base for p in self.policies}  # each policy's served adapter (the base at first)
                if checkpoint is not None:
                    trainer.load_state(checkpoint / TRAINER)
                    policy = state.adapter_names if self.multi else {cfg.run.name: state.adapter_name}
                    session.hot_load(policy, checkpoint)
                    self.console.print(f"resumed {self.run_dir} after iteration {state.completed} ({checkpoint.name})")
                if not eval_tasks:
                    self.console.print("no eval: data.eval is not set, so the untrained and trained models are not "
                                       "scored; set data.eval (held-out tasks, a dataset) for a before/after score",
                                       highlight=False, soft_wrap=True)
                if eval_tasks and baseline is None:
                    baseline = score(session, eval_tasks, {p.name: session.base for p in self.policies}, "untrained",
                                     eval_split)
                    state.baseline_eval, state.baseline_eval_stderr = baseline.mean, baseline.stderr
                    metrics.log_eval("untrained", baseline, 0, policy=session.base)
                self._started = time.perf_counter()  # each row's elapsed_s: the loop's pace, whatever overlaps
                loop = self._pipelined if cfg.train.max_staleness else self._train
                policy = loop(session, feed, policy, state, trainer, metrics)
                final = score(session, eval_tasks, policy, "trained", eval_split) if eval_tasks else None
                if final is not None:
                    metrics.log_eval("trained", final, cfg.run.iterations, policy=session.label(policy))
        except BaseException as e:  # the dashboard says why a run stopped, not only the console
            metrics.write_outcome("interrupted" if isinstance(e, KeyboardInterrupt) else "stopped",
                                  "Ctrl-C" if isinstance(e, KeyboardInterrupt) else str(e) or type(e).__name__)
            raise
        else:
            metrics.write_outcome("finished")
        finally:
            metrics.close()
        scored = final or baseline
        metrics.plot(state.history, baseline=state.baseline_eval, final=final.mean if final is not None else None,
                     eval_words=scored.words if scored else "eval")
        self._print_table(state, baseline, final)
        self.final_eval, self.final_score = (final.mean if final is not None else None), final
        return state

    # ------------------------------------------------------------------------------------------ the loop

    def _train(self, session: Session, feed: TaskFeed, policy: dict[str, str], state: RunState, trainer: Any,
               metrics: MetricsLog) -> dict[str, str]:
        """The iterations, one after another, each under the adapters the last one trained; returns the last."""
        for it in range(state.completed, self.cfg.run.iterations):
            batch = collect_batch(session, it + 1, feed.batch_for(it), policy)
            handover: dict[str, float] = {}  # sleep_s / wake_s: the server's GPU memory goes to the trainer meanwhile
            with status(self.console, f"iteration {batch.n}/{self.cfg.run.iterations} update: "
                                      f"{len(batch.transitions)} transitions"), \
                    gpu_handover(session.collector.server, handover):
                t = time.perf_counter()
                train_metrics = trainer.step(batch.transitions, batch.scored)
                update_s = time.perf_counter() - t
            policy = self._save_and_serve(session, batch, batch.row(train_metrics, update_s, handover), state,
                                          trainer, metrics, retire=policy)
        return policy

    def _pipelined(self, session: Session, feed: TaskFeed, policy: dict[str, str], state: RunState, trainer: Any,
                   metrics: MetricsLog) -> dict[str, str]:
        """The iterations with train.max_staleness = k >= 1 (lightning_sdk/pipeline.py): batch n is collected once
        update n - 1 - k is done, from whichever adapters are served meanwhile; the updates run in order on their
        own thread, each hot-loading its adapters the moment they are saved. Returns the last adapters served."""
        cfg, k = self.cfg, self.cfg.train.max_staleness
        versions = {served: state.completed for served in policy.values()}  # served name -> update that made it
        serving: list[dict[str, str]] = [dict(policy), {}]  # the adapters served now, and those they replaced
        session.route(policy)

        def update(batch: Batch) -> None:
            t = time.perf_counter()
            train_metrics = trainer.step(batch.transitions, batch.scored)
            update_s = time.perf_counter() - t
            # Known before the gateway routes a call to them, so no served call is ever of an unknown version.
            versions.update({served: batch.n for served in session.trained_names(batch.n).values()})
            # Requests routed to the adapter now replaced may still be queued at the server: the one it replaced
            # goes instead, an update later.
            new = self._save_and_serve(session, batch, batch.row(train_metrics, update_s, {}), state, trainer,
                                       metrics, retire=serving[1], route=True)
            serving[:] = [new, serving[0]]

        updates = UpdateThread(state.completed)
        try:
            for it in range(state.completed, cfg.run.iterations):
                n = it + 1
                updates.done(n - 1 - k)
                batch = collect_batch(session, n, feed.batch_for(it), None)
                kept, stale = split_stale(batch.transitions, versions, n - 1, k)
                if not kept:
                    raise CaptureError(f"iteration {n}: all {len(batch.transitions)} transitions were sampled more "
                                       f"than train.max_staleness = {k} updates before the one they would train")
                batch.transitions, batch.extra = kept, stale.metrics()
                updates.submit(n, lambda b=batch: update(b))
            updates.done(cfg.run.iterations)
        finally:  # Ctrl-C or an error: the running update finishes and saves; queued batches are collected again
            updates.close(cancel=True)
        return serving[0]

    def _save_and_serve(self, session: Session, batch: Batch, row: dict, state: RunState, trainer: Any,
                        metrics: MetricsLog, *, retire: dict[str, str], route: bool = False) -> dict[str, str]:
        """After batch n's update: the checkpoint, its adapters hot-loaded (each before the `retire`d one of its
        policy is dropped; `route`: and served from then on), and its row; returns the adapters it trained."""
        n, results, ok = batch.n, batch.results, batch.ok
        new_policy = session.trained_names(n)  # trained by iteration n, sampled by iteration n + 1
        if self.multi:
            # the calls each policy trained on, and those of components in no policy (served by the base)
            row.update({names.policy_transitions(p.name): sum(t.component in p.components for t in batch.transitions)
                        for p in self.policies})
            row[names.BASE_CALLS] = batch.base_calls
            state.adapter_names = new_policy
        else:
            state.adapter_name = new_policy[self.cfg.run.name]
        state.completed = n
        state.history.append(row)
        checkpoint = write_checkpoint(self.run_dir, n, trainer, state)
        t = time.perf_counter()
        session.hot_load(new_policy, checkpoint, retire)
        if route:
            session.route(new_policy)
        row[names.timing("hotload_s")] = time.perf_counter() - t
        row[names.timing("elapsed_s")] = time.perf_counter() - self._started
        metrics.log(row)
        failed = (f", {len(results) - len(ok)} of {len(results)} failed: {batch.failures}"
                  if len(ok) < len(results) else "")
        self.console.print(f"iteration {n}: reward {row[names.REWARD_MEAN]:.3f}  ({len(ok)} rollouts{failed}, "
                           f"{len(batch.transitions)} transitions, collect {batch.collect_s:.1f}s, update "
                           f"{row[names.timing('update_s')]:.1f}s, hot-load {row[names.timing('hotload_s')]:.2f}s)",
                           highlight=False,
                           soft_wrap=True, markup=False)
        return new_policy

    # ------------------------------------------------------------------------------------------ sessions

    @contextmanager
    def _opened(self, agent: Any, gateway: Any, model_path: str, store: Store, log_dir: Path) -> Iterator[Session]:
        """open_session, kept as `self.session` while it is open."""
        with open_session(self.cfg, self.console, agent, gateway, model_path, store, log_dir,
                          self.credit_rule) as session:
            self.session = session
            try:
                yield session
            finally:
                self.session = None

    def evaluate(self, tasks: list[dict], adapter: Path | dict[str, Path] | None = None, *,
                 iteration: int | None = None, keep: Path | None = None) -> Evaluated:
        """`lightning eval`: runtime.evaluation.evaluate with this run's config."""
        return evaluate(self.cfg, self.console, self.credit_rule, tasks, adapter, iteration=iteration, keep=keep,
                        resume=self.resume)

    @contextmanager
    def scratch_session(self, tasks: list[dict]) -> Iterator[tuple[Collector, Store]]:
        """The run's gateway, agent and inference server over a throwaway store that holds `tasks`: nothing is
        written into run.dir (`lightning check`). Bad input raises before the server starts."""
        with tempfile.TemporaryDirectory(prefix="lightning-scratch-") as tmp:
            with store_session(self.cfg, self.console, tasks, Path(tmp) / "store.sqlite", Path(tmp),
                               self.credit_rule, run_dir=self.run_dir, resume=self.resume) as session:
                yield session.collector, session.store

    def _print_table(self, state: RunState, baseline: EvalScore | None, final: EvalScore | None) -> None:
        table = iteration_table(self.cfg.run.name, state.history, baseline, final, beta=self.cfg.train.beta,
                                pipelined=bool(self.cfg.train.max_staleness))
        print_whole(self.console, table)
        last = latest_checkpoint(self.run_dir)
        if last is None:
            where = ""
        elif not self.multi:
            where = f"; trained adapter: {adapter_dir(last)}"
        else:
            where = f"; trained adapters: {', '.join(f'{k}: {v}' for k, v in policy_adapters(last).items())}"
        self.console.print(f"run directory: {self.run_dir}  (config.json, metrics.jsonl, reward_curve.png, "
                           f"tensorboard/, store.sqlite, checkpoints/){where}", highlight=False, soft_wrap=True)
