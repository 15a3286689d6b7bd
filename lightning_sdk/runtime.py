"""The loop behind `lightning run`: serve, collect, update, hot-load, repeat; and `lightning eval`.

One iteration = a collection phase (the collector runs the agent against the inference server, spans land in
the store) and an update phase (spans -> transitions -> one GRPO update -> a new LoRA adapter, hot-loaded into
the server). With [policies] there is one adapter per policy: the gateway serves each call by its component's. Each finished iteration is checkpointed atomically, so `--resume` continues a killed run from its
last complete update and never repeats one. `run` and `evaluate` share one session: agent, store, tracing,
collector and server, set up and torn down in one place.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import statistics
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from lightning_sdk import credit, data, models, tracing
from lightning_sdk.agent import load_agent, run_environment
from lightning_sdk.config import Config, effective, policies
from lightning_sdk.rollouts.remote.protocol import previous_port
from lightning_sdk.console import print_whole, printable, status
from lightning_sdk.errors import CaptureError, RunError, SetupError
from lightning_sdk.evals import EvalScore, eval_seed, split_of
from lightning_sdk.failures import cannot_train, first_line, summary
from lightning_sdk.files import DirBusyError, clean_atomic_leftovers, locked_dir, new_file
from lightning_sdk.metrics import MetricsLog, check_trackers
from lightning_sdk.pipeline import UpdateThread, split_stale
from lightning_sdk.rollouts.collector import Agent, Collector, make_collector, runs_agent
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.servers import ServerError, SleepableServer
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.process import new_api_key
from lightning_sdk.servers.select import cpu_threads, resolved_backend
from lightning_sdk.store import Store, eval_score, seal
from lightning_sdk.summary import iteration_table
from lightning_sdk.train.checkpoint import (CHECKPOINTS, TRAINER, RunState, adapter_dir, latest_checkpoint,
                                           policy_adapters, write_checkpoint)
from lightning_sdk.transitions import Transition, to_transitions

if TYPE_CHECKING:  # torch comes with the trainer, imported when a run starts
    from lightning_sdk.train.grpo import GroupOutcomes

__all__ = ["Evaluated", "RunError", "Runtime", "SetupError", "TaskFeed", "nothing_to_train", "policy_failure"]

MIN_FREE_BYTES = 64 * 2**20  # below this a run cannot even write its first checkpoint of a tiny model
RUN_LOCK = ".lock"  # in run.dir: held (flock) by the one `lightning run` using it


@dataclass(frozen=True)
class Evaluated:
    """What `Runtime.evaluate` scored: the score, the served policy's name, and the store file its rollouts were
    kept in (None: a throwaway store)."""

    score: EvalScore
    policy: str
    store: Path | None


class TaskFeed:
    """Deterministic batches: epoch e is the dataset shuffled with seed (seed, e), so resume sees the same tasks."""

    def __init__(self, tasks: list[dict], batch: int, *, seed: int, shuffle: bool):
        self.tasks, self.batch, self.seed, self.shuffle = tasks, batch, seed, shuffle

    def batch_for(self, iteration: int) -> list[dict]:
        start = iteration * self.batch
        out = []
        for k in range(start, start + self.batch):
            epoch, pos = divmod(k, len(self.tasks))
            order = list(range(len(self.tasks)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            out.append(self.tasks[order[pos]])
        return out


@dataclass
class Batch:
    """One iteration's collection, ready for its update."""

    n: int  # the iteration, from 1
    label: str  # the adapters it was collected from (when it began)
    results: list[RolloutResult]
    ok: list[RolloutResult]  # the succeeded rollouts
    transitions: list[Transition]
    scored: GroupOutcomes  # every scored rollout's outcome per group: the baselines
    skipped: Counter[str]  # calls, rollouts and rewards left out, by reason
    penalised: int  # failed rollouts trained at rollout.failed_reward
    collect_s: float
    base_calls: int  # with [policies]: calls of components in no policy, served by the base model
    failures: str = ""  # its failed rollouts in one line (failures.summary), "" when none failed
    extra: dict[str, float] = field(default_factory=dict)  # more of its row (pipelined: the staleness)


@contextmanager
def gpu_handover(server: Any, timings: dict[str, float]) -> Iterator[None]:
    """Around the update phase: a server that can sleep (vLLM) frees its GPU memory for the trainer, then wakes.

    Records sleep_s and wake_s in `timings`; a server without sleep support (the CPU server) is left alone.
    """
    if not (isinstance(server, SleepableServer) and server.can_sleep):
        yield
        return
    t = time.perf_counter()
    server.sleep()
    timings["sleep_s"] = time.perf_counter() - t
    yield
    t = time.perf_counter()
    server.wake_up()
    timings["wake_s"] = time.perf_counter() - t


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
        self.collector: Collector | None = None  # set while a session is open
        self._store: Store | None = None  # the session's store, while it is open
        self._started = 0.0  # when this process began its iterations
        self.final_eval: float | None = None
        self.final_score: EvalScore | None = None  # the trained eval, with its standard error
        self.policies = policies(cfg)
        self.multi = bool(cfg.policies)  # one adapter per policy, each call served by its component's

    # The whole run, top to bottom.
    def run(self) -> RunState:
        with ExitStack() as stack:  # holds run.dir's lock until the run has ended
            return self._run(stack)

    def _run(self, stack: ExitStack) -> RunState:
        cfg = self.cfg
        gateway = self._agent_side(stack)
        agent = self._load_agent()
        train_tasks = data.load(cfg.data.train, cfg.data.required_fields)
        eval_tasks = data.load(cfg.data.eval, cfg.data.required_fields) if cfg.data.eval else []
        model_path = models.resolve(cfg.model.name)  # before the run directory: bad input writes nothing
        check_trackers(cfg.run.report_to)
        self._preflight()
        checkpoint = self._prepare_run_dir(stack)
        if checkpoint is not None:
            from lightning_sdk.train.trainer import checkpoint_conflict

            conflict = checkpoint_conflict(checkpoint / TRAINER, cfg.train, self.policies if self.multi else None)
            if conflict:
                raise SetupError(conflict)  # before the store or the metrics are touched
        # Bad input has had its one line by now; the rest takes a while (the trainer's imports, the model, the
        # server), and a log that stays empty meanwhile looks like a hang.
        self.console.print(f"run {cfg.run.name!r}: {cfg.run.iterations} iterations of {cfg.model.name} in "
                           f"{cfg.run.dir}; starting the model server and the agent", highlight=False, soft_wrap=True,
                           markup=False)
        from lightning_sdk.train.ranks import start_trainer
        split = cpu_threads(cfg)
        if split is not None and split[1] is not None:  # the trainer's share of the cores; the server has the rest
            import torch

            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(split[1])
        state = RunState.read(checkpoint) if checkpoint is not None else RunState()
        store = stack.enter_context(Store(self.run_dir / "store.sqlite"))  # closed (its WAL folded in) before the lock
        abandoned = store.abandon_running()
        if abandoned:
            self.console.print(f"[yellow]{abandoned} rollout(s) left running by the previous process marked abandoned")
        untrained = store.mark_untrained(state.completed)
        if untrained:
            self.console.print(f"[yellow]{untrained} rollout(s) collected after iteration {state.completed}, whose update "
                               f"never completed, marked untrained; that iteration is collected again")
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
            with self._session(agent, gateway, model_path, store, self.run_dir) as collector:
                # train.processes > 1: data-parallel processes (train/ranks.py), stopped with the run
                trainer = start_trainer(model_path, cfg.train, stack, quantization=cfg.model.quantization,
                                        dtype=cfg.model.dtype, seed=cfg.run.seed,
                                        total_steps=cfg.run.iterations * cfg.train.epochs,
                                        policies=self.policies if self.multi else None,
                                        backend=resolved_backend(cfg))
                base = collector.server.served_model_name
                policy = {p.name: base for p in self.policies}  # each policy's served adapter (the base at first)
                if checkpoint is not None:
                    trainer.load_state(checkpoint / TRAINER)
                    policy = state.adapter_names if self.multi else {cfg.run.name: state.adapter_name}
                    paths = self._adapter_paths(checkpoint)
                    for name, served in policy.items():
                        collector.hot_load(served, paths[name])
                    self.console.print(f"resumed {self.run_dir} after iteration {state.completed} ({checkpoint.name})")
                if not eval_tasks:
                    self.console.print("no eval: data.eval is not set, so the untrained and trained models are not "
                                       "scored; set data.eval (held-out tasks, a dataset) for a before/after score",
                                       highlight=False, soft_wrap=True)
                if eval_tasks and baseline is None:
                    baseline = self._evaluate(eval_tasks, {p.name: base for p in self.policies}, "untrained",
                                              eval_split)
                    state.baseline_eval, state.baseline_eval_stderr = baseline.mean, baseline.stderr
                    metrics.log_eval("untrained", baseline, 0, policy=base)
                self._started = time.perf_counter()  # each row's elapsed_s: the loop's pace, whatever overlaps
                if cfg.train.max_staleness:
                    policy = self._pipelined(feed, policy, state, store, trainer, metrics)
                else:
                    for it in range(state.completed, cfg.run.iterations):
                        policy = self._iteration(it, feed.batch_for(it), policy, state, store, trainer, metrics)
                final = self._evaluate(eval_tasks, policy, "trained", eval_split) if eval_tasks else None
                if final is not None:
                    metrics.log_eval("trained", final, cfg.run.iterations, policy=self._label(policy))
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

    def evaluate(self, tasks: list[dict], adapter: Path | dict[str, Path] | None = None, *,
                 iteration: int | None = None, keep: Path | None = None) -> Evaluated:
        """Score the base model, or the base with `adapter` (a PEFT directory; with [policies], one per policy,
        each serving its components' calls), on `tasks`: `lightning eval`. `iteration`: the update that made the
        adapter, which names it (`<run>-iter<N>`) and the rollouts' iteration (0 for the base model).

        The rollouts go to a store of their own, never the run's (which a running run owns, and whose eval scores
        the dashboard reads per iteration): with `keep` (a run's evals/ folder) a new file there,
        `<UTC time>-iter<N>.sqlite`, that appears only complete and never replaces one; else a throwaway store.
        """
        name = self.cfg.run.name
        train = data.load(self.cfg.data.train, self.cfg.data.required_fields)
        split = split_of(map(data.task_id, tasks), map(data.task_id, train))
        tag = "untrained" if adapter is None else f"iter{iteration}" if iteration is not None else "adapter"
        with ExitStack() as stack:
            if keep is None:
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lightning-scratch-")))
                db = folder / "store.sqlite"
            else:
                stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                kept = stack.enter_context(new_file(keep, f"{stamp}-{tag}", ".sqlite"))
                db, folder = kept.tmp, Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lightning-eval-")))
            with self._store_session(tasks, db, folder) as (collector, _):
                policy = {p.name: collector.server.served_model_name for p in self.policies}
                adapters = {name: adapter} if isinstance(adapter, Path) else adapter or {}
                for policy_name, path in adapters.items():
                    policy[policy_name] = f"{name}-{tag}" if not self.multi else f"{name}-{policy_name}-{tag}"
                    collector.hot_load(policy[policy_name], path)
                score = self._evaluate(tasks, policy, "trained" if adapter is not None else "untrained", split,
                                       iteration=0 if adapter is None else iteration or 0, say=False)
                served = self._label(policy)
            if keep is not None:
                seal(db)  # before it appears: readers of it then write nothing beside it
        return Evaluated(score, served, kept.path if keep is not None else None)

    @contextmanager
    def scratch_session(self, tasks: list[dict]) -> Iterator[tuple[Collector, Store]]:
        """The run's gateway, agent and inference server over a throwaway store that holds `tasks`: nothing is
        written into run.dir (`lightning check`). Bad input raises before the server starts."""
        with tempfile.TemporaryDirectory(prefix="lightning-scratch-") as tmp:
            with self._store_session(tasks, Path(tmp) / "store.sqlite", Path(tmp)) as session:
                yield session

    @contextmanager
    def _store_session(self, tasks: list[dict], db: Path, log_dir: Path) -> Iterator[tuple[Collector, Store]]:
        """The run's gateway, agent and inference server over the store `db`, which gets `tasks`."""
        with ExitStack() as stack:
            gateway = self._agent_side(stack)
            agent = self._load_agent()
            model_path = models.resolve(self.cfg.model.name)
            store = stack.enter_context(Store(db))
            store.add_tasks((data.task_id(t), t) for t in tasks)
            with self._session(agent, gateway, model_path, store, log_dir) as collector:
                yield collector, store

    # ------------------------------------------------------------------------------------------ the session

    def _agent_side(self, stack: ExitStack) -> Gateway:
        """The run's gateway, bound (serve.host/serve.port: a SetupError naming the key if it cannot be), and the
        agent process's environment pointing at it (agent.redirect_openai) until `stack` closes: set before the
        agent module is imported, so OpenAI clients it builds at import time call the run's server too."""
        cfg = self.cfg
        api_key = cfg.serve.api_key or new_api_key()

        def listen(port: int) -> Gateway:
            return Gateway(host=cfg.serve.host, port=port, api_key=api_key, model_names=cfg.serve.model_names)

        gateway = None
        if self.resume and cfg.serve.port == 0 and (port := previous_port(self.run_dir)):
            try:  # where the killed run served: its remote workers, retrying meanwhile, find the run again
                gateway = listen(port)
            except OSError:
                pass  # taken meanwhile: any free port, as serve.port = 0 asks
        try:
            gateway = gateway or listen(cfg.serve.port)
        except OSError as e:
            key = ("serve.port", cfg.serve.port) if e.errno == errno.EADDRINUSE else ("serve.host", cfg.serve.host)
            raise SetupError(f"{key[0]} = {key[1]!r}: cannot listen on {cfg.serve.host}:{cfg.serve.port} "
                             f"({e.strerror}); " + ("another process holds the port: free it, or set serve.port = "
                             "0 for any free one" if key[0] == "serve.port" else
                             "expected an address of this machine, e.g. 127.0.0.1")) from None
        stack.callback(gateway.stop)
        stack.enter_context(run_environment(gateway.base_url, gateway.api_key,
                                            redirect_openai=cfg.agent is None or cfg.agent.redirect_openai))
        return gateway

    def _load_agent(self) -> Agent | None:
        """The agent's functions; None where the runtime's workers run it (they import it, this process never)."""
        a = self.cfg.agent
        if not runs_agent(self.cfg.run.runtime):
            return None
        rollout_fn, reward_fn = load_agent(a.module, a.rollout, a.reward)
        return Agent(a.module, rollout_fn, reward_fn)

    @contextmanager
    def _session(self, agent: Agent | None, gateway: Gateway, model_path: str, store: Store,
                 log_dir: Path) -> Iterator[Collector]:
        """Tracing into `store`, and the collector (its inference server, the gateway in front) started; all
        undone on exit."""
        tracing.install(store, gateway_url=gateway.base_url, otlp_endpoint=self.cfg.run.otlp_endpoint)
        gateway.capture.record_to(store)
        gateway.capture.exported = tracing.export_received
        collector = make_collector(self.cfg, agent=agent, gateway=gateway, model_path=model_path, store=store,
                                   log_dir=log_dir, console=self.console)
        with status(self.console, "starting the inference server"):
            try:
                collector.start()
            except ServerError as e:
                collector.stop()
                raise RunError(f"the inference server did not start: {e}") from None
        self.collector, self._store = collector, store
        try:
            yield collector
        except BaseException:
            # Ending on an error or a Ctrl-C: a teardown that fails too (spans that do not drain in time on a loaded
            # machine) is said, never raised in its place, so the run ends with what stopped it (exit 130 for Ctrl-C).
            try:
                self._end_session(collector, gateway)
            except Exception as e:  # noqa: BLE001 - reported; the error in flight is raised
                self.console.print(f"[yellow]while stopping: {escape(first_line(f'{type(e).__name__}: {e}'))}",
                                   highlight=False, soft_wrap=True)
            raise
        self._end_session(collector, gateway)

    def _end_session(self, collector: Collector, gateway: Gateway) -> None:
        self.collector = self._store = None
        try:
            collector.stop()
        finally:
            gateway.capture.flush()
            gateway.capture.record_to(None)
            tracing.flush()

    def _preflight(self) -> None:
        """What would otherwise fail after the run directory is written: where it goes, the backend, the training
        device (the port is checked when the gateway binds it). Each is a SetupError naming the key."""
        cfg, d = self.cfg, self.run_dir
        if d.exists() and not d.is_dir():
            raise SetupError(f"run.dir = {str(d)!r}: is a file; expected a directory (or a path that does not exist "
                             f"yet)")
        base = next(p for p in (d, *d.parents) if p.exists())
        if not base.is_dir():
            raise SetupError(f"run.dir = {str(d)!r}: {base} is a file, so no directory can be made under it")
        fs = os.statvfs(base)
        if fs.f_blocks == 0:  # procfs, sysfs: virtual file systems hold no files of ours
            raise SetupError(f"run.dir = {str(d)!r}: {base} is on a virtual file system (like /proc); choose a "
                             f"directory on a disk")
        if fs.f_flag & os.ST_RDONLY or not os.access(base, os.W_OK | os.X_OK):
            raise SetupError(f"run.dir = {str(d)!r}: {base} is read-only for this user; choose a writable directory")
        free = fs.f_bavail * fs.f_frsize
        if free < MIN_FREE_BYTES:
            raise SetupError(f"run.dir = {str(d)!r}: only {free / 2**20:.1f} MiB free on its disk; a run needs at "
                             f"least {MIN_FREE_BYTES / 2**20:.0f} MiB for its store and checkpoints")
        if cfg.train.max_staleness and cfg.serve.sleep_level and resolved_backend(cfg) == "vllm":
            raise SetupError(f"train.max_staleness = {cfg.train.max_staleness} updates while vLLM serves, so both "
                             f"must fit in memory at once, but serve.sleep_level = {cfg.serve.sleep_level} puts vLLM "
                             f"to sleep for each update: set serve.sleep_level = 0 (and serve.gpu_memory_utilization "
                             f"to leave the trainer room), or train.max_staleness = 0")
        if cfg.serve.backend == "vllm":
            from lightning_sdk.servers.select import check_vllm

            check_vllm(cfg)  # refuses vllm where it cannot run
        for key, device in (("serve.device", cfg.serve.device), ("train.device", cfg.train.device)):
            if device.startswith("cuda"):
                import torch

                if not torch.cuda.is_available():
                    raise SetupError(f"{key} = {device!r}: no CUDA GPU is visible to torch; use 'cpu'"
                                     + (" or 'auto'" if key == "train.device" else ""))
                index = int(device.partition(":")[2] or 0)
                if index >= torch.cuda.device_count():
                    raise SetupError(f"{key} = {device!r}: torch sees {torch.cuda.device_count()} GPU(s)")
        device = cfg.train.device
        if device == "mps":
            import torch

            if not torch.backends.mps.is_available():
                raise SetupError("train.device = 'mps': MPS is not available here; use 'cpu' or 'auto'")

    def _prepare_run_dir(self, stack: ExitStack) -> Path | None:
        """Check run.dir, take its lock (held in `stack` for the whole run), and return the checkpoint to resume."""
        d = self.run_dir
        existing = d.exists() and any(p.name != RUN_LOCK for p in d.iterdir())
        if existing and not self.resume and not self.overwrite:
            raise SetupError(f"run.dir {d} already holds a run; pass --resume to continue it, --overwrite to "
                             f"replace it, or --run-dir for a new one")
        try:  # before anything is deleted or written: two runs on one directory would collect the same iteration
            stack.enter_context(locked_dir(d, RUN_LOCK))
        except DirBusyError as e:
            raise SetupError(f"run.dir {e}: another `lightning run` is using it; wait for it to end, or use "
                             f"--run-dir for a new run") from None
        if existing and self.overwrite:
            for p in d.iterdir():  # all but the lock we hold
                if p.name != RUN_LOCK:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            return None
        if not self.resume:
            return None
        cleaned = clean_atomic_leftovers(d / CHECKPOINTS)
        if cleaned:
            self.console.print(f"removed {cleaned} unfinished checkpoint write(s) of a killed run from "
                               f"{d / CHECKPOINTS}")
        return latest_checkpoint(d)

    # ------------------------------------------------------------------------------------------ one iteration

    def _iteration(self, it: int, tasks: list[dict], policy: dict[str, str], state: RunState, store: Store,
                   trainer: Any, metrics: MetricsLog) -> dict[str, str]:
        """One iteration under `policy` (each policy's served adapter); returns the adapters it trained."""
        batch = self._collect_batch(it + 1, tasks, policy, store)
        handover: dict[str, float] = {}  # sleep_s / wake_s: the server's GPU memory goes to the trainer meanwhile
        with status(self.console, f"iteration {batch.n}/{self.cfg.run.iterations} update: "
                                 f"{len(batch.transitions)} transitions"), \
                gpu_handover(self.collector.server, handover):
            t1 = time.perf_counter()
            train_metrics = trainer.step(batch.transitions, batch.scored)
            update_s = time.perf_counter() - t1
        return self._finish(batch, train_metrics, update_s, handover, state, trainer, metrics, retire=policy)

    def _pipelined(self, feed: TaskFeed, policy: dict[str, str], state: RunState, store: Store, trainer: Any,
                   metrics: MetricsLog) -> dict[str, str]:
        """The iterations with train.max_staleness = k >= 1 (lightning_sdk/pipeline.py): batch n is collected once
        update n - 1 - k is done, from whichever adapters are served meanwhile; the updates run in order on their
        own thread, each hot-loading its adapters the moment they are saved. Returns the last adapters served."""
        cfg, k = self.cfg, self.cfg.train.max_staleness
        versions = {served: state.completed for served in policy.values()}  # served name -> update that made it
        serving: list[dict[str, str]] = [dict(policy), {}]  # the adapters served now, and those they replaced
        self._route(policy)

        def update(batch: Batch) -> None:
            t1 = time.perf_counter()
            train_metrics = trainer.step(batch.transitions, batch.scored)
            update_s = time.perf_counter() - t1
            # Known before the gateway routes a call to them, so no served call is ever of an unknown version.
            versions.update({served: batch.n for served in self._trained_names(batch.n).values()})
            # Requests routed to the adapter now replaced may still be queued at the server: the one it replaced
            # goes instead, an update later.
            new = self._finish(batch, train_metrics, update_s, {}, state, trainer, metrics, retire=serving[1],
                               route=True)
            serving[:] = [new, serving[0]]

        updates = UpdateThread(state.completed)
        try:
            for it in range(state.completed, cfg.run.iterations):
                n = it + 1
                updates.done(n - 1 - k)
                batch = self._collect_batch(n, feed.batch_for(it), None, store)
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

    def _collect_batch(self, n: int, tasks: list[dict], policy: dict[str, str] | None, store: Store) -> Batch:
        """Iteration n's rollouts collected under `policy` (None: as the gateway routes now), and their
        transitions."""
        cfg, collector = self.cfg, self.collector
        jobs = [RolloutJob(rollout_id=f"it{n:04d}-{i:03d}-{g}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                           group_id=f"{n}:{i}", task=t, iteration=n)
                for i, t in enumerate(tasks) for g in range(cfg.data.group_size)]
        t0 = time.perf_counter()
        base_calls = sum(collector.gateway.base_served.values())
        label = self._label(policy) if policy is not None else self._label(self._routed())
        results = self._collect(jobs, policy, f"iteration {n}/{cfg.run.iterations} collect")
        collect_s = time.perf_counter() - t0
        ok = [r for r in results if r.status == "succeeded"]
        failed = len(results) - len(ok)
        failures = self._failures(results, store)
        if len(ok) < len(results) / 2:
            raise RunError(f"iteration {n}: {failed} of {len(results)} rollouts failed ({failures}); not training on "
                           f"the rest. See `lightning traces --run-dir {self.run_dir} --status failed`.")
        skipped: Counter[str] = Counter()
        penalised = [r for r in results if policy_failure(r)] if cfg.rollout.failed_reward is not None else []
        transitions, scored = self._transitions(ok, store, skipped, penalised)
        return Batch(n, label, results, ok, transitions, scored, skipped, len(penalised), collect_s,
                     sum(collector.gateway.base_served.values()) - base_calls, failures)

    @staticmethod
    def _failures(results: list[RolloutResult], store: Store) -> str:
        """The failed rollouts among `results` in one line (failures.summary, with the user's line that raised from
        the stored traceback); "" when none failed."""
        failed = [r for r in results if r.status != "succeeded"]
        records = {r.job.rollout_id: store.rollout(r.job.rollout_id) for r in failed}
        return summary((r.error, getattr(records[r.job.rollout_id], "traceback", None)) for r in failed)

    def _finish(self, batch: Batch, train_metrics: dict[str, float], update_s: float, handover: dict[str, float],
                state: RunState, trainer: Any, metrics: MetricsLog, *, retire: dict[str, str],
                route: bool = False) -> dict[str, str]:
        """After batch n's update: its row, the checkpoint, and its adapters hot-loaded (each before the `retire`d
        one of its policy is dropped; `route`: and served from then on); returns the adapters it trained."""
        cfg, collector, n = self.cfg, self.collector, batch.n
        results, ok, transitions = batch.results, batch.ok, batch.transitions
        rewards = [r.reward for r in ok]
        # statistics: exact sums, so a finite reward as large as 1e200 gives a finite mean, not an OverflowError
        mean = float(statistics.mean(rewards))
        row = {
            "iteration": n, "policy": batch.label, "reward_mean": mean, "reward_std": statistics.pstdev(rewards),
            "rollouts": len(results), "failed": len(results) - len(ok), "transitions": len(transitions),
            "completion_tokens": sum(len(t.completion_ids) for t in transitions),
            "failed_trained": batch.penalised, **{f"skipped.{k}": v for k, v in sorted(batch.skipped.items()) if v},
            "collect_s": batch.collect_s, "update_s": update_s, **handover,
            **{f"train.{k}": v for k, v in train_metrics.items()}, **batch.extra,
        }
        # trained by iteration n, sampled by iteration n + 1
        new_policy = self._trained_names(n)
        if self.multi:
            # the calls each policy trained on, and those of components in no policy (served by the base)
            row.update({f"transitions.{p.name}": sum(t.component in p.components for t in transitions)
                        for p in self.policies}, base_calls=batch.base_calls)
            state.adapter_names = new_policy
        else:
            state.adapter_name = new_policy[cfg.run.name]
        state.completed = n
        state.history.append(row)
        checkpoint = write_checkpoint(self.run_dir, n, trainer, state)
        t2 = time.perf_counter()
        paths = self._adapter_paths(checkpoint)
        for name, served in new_policy.items():  # each new adapter loaded before its previous one goes
            collector.hot_load(served, paths[name], previous=retire.get(name))
        if route:
            self._route(new_policy)
        row["hotload_s"] = time.perf_counter() - t2
        row["elapsed_s"] = time.perf_counter() - self._started
        metrics.log(row)
        failed = (f", {len(results) - len(ok)} of {len(results)} failed: {batch.failures}"
                  if len(ok) < len(results) else "")
        self.console.print(f"iteration {n}: reward {mean:.3f}  ({len(ok)} rollouts{failed}, {len(transitions)} "
                           f"transitions, collect {batch.collect_s:.1f}s, update {update_s:.1f}s, "
                           f"hot-load {row['hotload_s']:.2f}s)", highlight=False, soft_wrap=True, markup=False)
        return new_policy

    def _transitions(self, ok: list[RolloutResult], store: Store, skipped: Counter,
                     penalised: list[RolloutResult] = ()) -> tuple[list[Transition], GroupOutcomes]:
        """Transitions of the succeeded rollouts, and of the failed ones trained at rollout.failed_reward, and the
        outcome of each of those rollouts per group, whether it left a transition or not (the group baselines);
        `skipped` counts the LLM calls, rollouts and rewards left out, by reason (transitions.to_transitions)."""
        capture = self.collector.gateway.capture
        if not capture.flush():
            raise RunError("the gateway's call records did not reach the store within 30 s")
        tracing.flush()
        errors = capture.errors + tracing.writer_errors()
        if errors:
            raise RunError(f"writing call records or spans failed, some may be missing: {errors[0]}")
        if store.span_conflicts:
            self.console.print(f"[yellow]{store.span_conflicts} span(s) refused so far: their ids were taken by "
                               f"spans already stored (those are kept); see the log")
        out: list[Transition] = []
        scored: dict[str, dict[str, float]] = defaultdict(dict)
        for r in [*ok, *penalised]:
            record = store.rollout(r.job.rollout_id)
            failed_reward = self.cfg.rollout.failed_reward if r.status == "failed" else None
            out += to_transitions(record, store.spans(r.job.rollout_id), credit=self.credit_rule,
                                  components=self._trained_components(), error_reward=self.cfg.rollout.error_reward,
                                  skipped=skipped, failed_reward=failed_reward)
            scored[record.group_id][record.rollout_id] = float(record.reward if failed_reward is None
                                                               else failed_reward)
        if not out:
            raise CaptureError(nothing_to_train([r.job.rollout_id for r in ok], skipped, capture.unattributed,
                                                 self._trained_components()))
        return out, dict(scored)

    def _trained_components(self) -> list[str]:
        """The components whose calls become transitions (empty: all)."""
        return [c for p in self.policies for c in p.components]

    def _adapter_paths(self, checkpoint: Path) -> dict[str, Path]:
        """Each policy's adapter directory in `checkpoint`."""
        return policy_adapters(checkpoint) if self.multi else {self.cfg.run.name: adapter_dir(checkpoint)}

    def _label(self, policy: dict[str, str]) -> str:
        """The served adapters as one line: the adapter's name, or `policy=adapter` for each of several."""
        return ", ".join(f"{k}={v}" for k, v in policy.items()) if self.multi else policy[self.cfg.run.name]

    def _trained_names(self, n: int) -> dict[str, str]:
        """Each policy's adapter as update n saves and serves it."""
        run = self.cfg.run.name
        return {p.name: f"{run}-{p.name}-iter{n}" if self.multi else f"{run}-iter{n}" for p in self.policies}

    def _route(self, policy: dict[str, str]) -> None:
        """Serve every call by `policy` (each policy's adapter) from now on: with [policies] each call by its
        component's policy, the components in no policy by the base model."""
        gateway = self.collector.gateway
        gateway.retired.update(n for n in [gateway.policy, *gateway.by_component.values()] if n is not None)
        if self.multi:
            gateway.by_component = {c: policy[p.name] for p in self.policies for c in p.components}
            gateway.policy = self.collector.server.served_model_name
        else:
            gateway.policy = policy[self.cfg.run.name]  # whatever model name the agent asks for

    def _routed(self) -> dict[str, str]:
        """The adapters the gateway serves now, by policy."""
        gateway = self.collector.gateway
        if not self.multi:
            return {self.cfg.run.name: gateway.policy}
        return {p.name: gateway.by_component.get(p.components[0], gateway.policy) for p in self.policies}

    def _collect(self, jobs: list[RolloutJob], policy: dict[str, str] | None, label: str) -> list[RolloutResult]:
        """`jobs` run under `policy` (None: however the gateway routes meanwhile)."""
        if policy is not None:
            self._route(policy)
        gateway = self.collector.gateway
        results = self.collector.collect(jobs, gateway.policy, label=label)
        bad = [r for r in results if r.failed_in == "reward"]
        if bad and self.cfg.rollout.on_reward_error == "stop":
            raise RunError(f"{len(bad)} rollout(s) got no usable reward and rollout.on_reward_error = 'stop'; "
                           f"first: {printable(first_line(bad[0].error or ''), 2000)}")
        return results

    def _evaluate(self, tasks: list[dict], policy: dict[str, str], label: str, split: tuple[str, int],
                  iteration: int | None = None, *, say: bool = True) -> EvalScore:
        """Each task once under `policy`; rollouts stored with phase 'eval' at `iteration` (default: 0 untrained,
        run.iterations trained), each sampling with its task's seed (evals.eval_seed). `say`: print the score line
        (`lightning eval` prints its own)."""
        phase_it = iteration if iteration is not None else 0 if label == "untrained" else self.cfg.run.iterations
        jobs = [RolloutJob(rollout_id=f"eval-{label}-{i:04d}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                           group_id=f"eval:{label}:{i}", task=t, iteration=phase_it, phase="eval",
                           seed=eval_seed(self.cfg.run.seed, data.task_id(t)))
                for i, t in enumerate(tasks)]
        results = self._collect(jobs, policy, f"eval ({label})")
        failed = sum(r.status != "succeeded" for r in results)
        score = EvalScore.of([eval_score(r.reward) for r in results], *split, failed=failed,
                             failures=self._failures(results, self._store) if failed else "")
        if say:
            self.console.print(f"eval ({label}, {self._label(policy)}): {score.words} {score} over {score.n} tasks "
                               f"(mean reward ± standard error){score.failed_words}", highlight=False,
                               soft_wrap=True, markup=False)
        return score

    def _print_table(self, state: RunState, baseline: EvalScore | None, final: EvalScore | None) -> None:
        table = iteration_table(self.cfg.run.name, state.history, baseline, final, beta=self.cfg.train.beta,
                                pipelined=bool(self.cfg.train.max_staleness))
        print_whole(self.console, table)
        last = latest_checkpoint(self.run_dir)
        self.console.print(f"run directory: {self.run_dir}  (config.json, metrics.jsonl, reward_curve.png, "
                           f"tensorboard/, store.sqlite, checkpoints/)"
                           + (f"; trained adapter: {adapter_dir(last)}" if last is not None and not self.multi else
                              f"; trained adapters: {', '.join(f'{k}: {v}' for k, v in self._adapter_paths(last).items())}"
                              if last is not None else ""),
                           highlight=False, soft_wrap=True)


# Failures that are not the policy's: the runtime's own timeout, and the server unreachable or failing.
_INFRASTRUCTURE = ("TimeoutError", "APITimeoutError", "APIConnectionError", "InternalServerError")


def policy_failure(r: RolloutResult) -> bool:
    """A failed rollout that rollout.failed_reward penalises: its agent raised (e.g. on output it could not parse,
    or a 400 for a prompt the episode grew past the context); never a reward fault or infrastructure."""
    return (r.status == "failed" and r.failed_in == "rollout"
            and not (r.error or "").startswith(tuple(f"{n}:" for n in _INFRASTRUCTURE)))


def nothing_to_train(rollouts: list[str], skipped: Counter, unattributed: int, components: list[str]) -> str:
    """Why an iteration has no transition at all, in words, from what was seen."""
    seen = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()) if n) or "nothing left out"
    if skipped["no_llm_call"] == len(rollouts):
        why = (f"no LLM call was captured: no rollout (e.g. rollout {rollouts[0] if rollouts else '-'}) made an LLM "
               f"call the gateway could attribute to it; the agent must call the run's server (OPENAI_BASE_URL, or "
               f"the `llm` argument's base_url) inside the @rollout function")
        if unattributed:
            why += (f"; the gateway served {unattributed} call(s) of no rollout: a client that sends no W3C "
                    f"traceparent, or a call made outside the rollout's context (docs/remote.md: the per-rollout "
                    f"base URL serves such clients)")
        return (f"no transitions from {len(rollouts)} rollouts: {why} (left out: {seen}). "
                f"`lightning check` shows each rollout")
    why, fix = cannot_train(skipped, components, [])
    return (f"no transitions from {len(rollouts)} rollouts: {why} (left out: {seen}). Fix: {fix}. "
            f"`lightning check` shows each rollout")
