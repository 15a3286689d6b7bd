"""The embedded single-node runtime behind `lightning run`: serve, collect, update, hot-load, repeat.

One iteration = a collection phase (rollout workers run the agent against the inference server, spans land in
the store) and an update phase (spans -> transitions -> one GRPO update -> a new LoRA adapter, loaded into the
server without a restart). Each finished iteration is checkpointed atomically, so `--resume` continues a
killed run from its last complete update and never repeats one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import json
import logging
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from lightning_sdk import adapter, credit, data, models, tracing
from lightning_sdk.agent import LLM, is_reward, is_rollout
from lightning_sdk.config import Config
from lightning_sdk.metrics import MetricsLog
from lightning_sdk.serving import ServerError, SleepableServer
from lightning_sdk.store import Store
from lightning_sdk.worker import RolloutJob, RolloutResult, run_rollout

MAX_SERVER_RESTARTS = 3  # per run: a server that keeps dying is a bug to fix, not to retry forever

log = logging.getLogger("lightning_sdk")

CHECKPOINTS = "checkpoints"
STATE = "state.json"


class RunError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


class SetupError(RunError):
    """Bad input found before anything ran (agent, run directory, backend): the CLI exits 2, as for bad config."""


# ------------------------------------------------------------------------------------------- the user's agent

def load_agent(module: str, rollout_name: str | None, reward_name: str | None) -> tuple[Callable, Callable]:
    if module.endswith(".py"):
        path = Path(module)
        if not path.exists():
            raise SetupError(f"agent.module = {module!r}: file not found")
        sys.path.insert(0, str(path.parent))  # let the agent import its sibling modules
        spec = importlib.util.spec_from_file_location(f"lightning_agent_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)

    def pick(kind: str, name: str | None, test: Callable[[Any], bool]) -> Callable:
        if name is not None:
            fn = getattr(mod, name, None)
            if fn is None or not test(fn):
                raise SetupError(f"agent.{kind} = {name!r}: {module} has no @{kind} function of that name")
            return fn
        found = [v for v in vars(mod).values() if test(v)]
        if len(found) != 1:
            names = ", ".join(f.__name__ for f in found) or "none"
            raise SetupError(f"agent.module = {module!r}: expected exactly one @{kind} function (found: {names}); "
                           f"name it with agent.{kind}")
        return found[0]

    return pick("rollout", rollout_name, is_rollout), pick("reward", reward_name, is_reward)


# ---------------------------------------------------------------------------------------------- checkpoints

@dataclass
class RunState:
    """What a checkpoint remembers besides the weights: finished iterations and their metrics."""

    completed: int = 0  # iterations finished and checkpointed
    history: list[dict[str, Any]] = field(default_factory=list)
    baseline_eval: float | None = None
    adapter_name: str | None = None

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2)


def latest_checkpoint(run_dir: Path) -> Path | None:
    # A checkpoint directory only ever appears by an atomic rename of a complete one.
    done = sorted((run_dir / CHECKPOINTS).glob("iter-*"))
    return done[-1] if done else None


def adapter_dir(checkpoint: Path) -> Path:
    """The checkpoint's PEFT adapter (what `PeftModel.from_pretrained` and the server's hot-load take)."""
    from lightning_sdk.trainer import ADAPTER_SUBDIR

    return checkpoint / "trainer" / ADAPTER_SUBDIR


def write_checkpoint(run_dir: Path, iteration: int, trainer: Any, state: RunState, keep: int = 3) -> Path:
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter-{iteration:05d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    trainer.save_state(tmp / "trainer")  # holds the PEFT adapter directory too: see adapter_dir()
    (tmp / STATE).write_text(state.to_json())
    tmp.rename(final)
    for old in sorted(root.glob("iter-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------- the task feed

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


# ----------------------------------------------------------------------------------------------- the runtime

def make_server(cfg: Config, model_path: str, log_path: Path):
    from lightning_sdk.serving.cpu import CPUServer

    if cfg.run.runtime == "ray":  # server actors behind a router, plus the rollout pool: lightning_sdk/cluster.py
        try:
            from lightning_sdk.cluster import RayCluster
        except ImportError as e:
            raise SetupError(f"run.runtime = 'ray' needs Ray: pip install 'lightning-sdk[ray]' ({e})") from None
        return RayCluster(cfg, model_path, log_path.parent)

    backend = cfg.serve.backend
    if backend != "cpu":
        from lightning_sdk.serving.vllm import vllm_unavailable_reason

        why_not = vllm_unavailable_reason()
        if backend == "auto":
            backend = "cpu" if why_not else "vllm"
            log.info("serve.backend = 'auto': using %s", f"the built-in CPU server ({why_not})" if why_not
                     else "vLLM (CUDA GPU and vllm found)")
        elif why_not:
            raise SetupError(f"serve.backend = 'vllm': {why_not}. Install the GPU extra with "
                             f"`pip install 'lightning-sdk[gpu]'` (its own environment, docs/gpu.md) on a CUDA "
                             f"machine, or set serve.backend = 'cpu'")
    if backend == "vllm":
        return vllm_server(cfg, model_path, log_path)
    return CPUServer(
        model_path, served_model_name=cfg.model.name, host=cfg.serve.host, port=cfg.serve.port,
        api_key=cfg.serve.api_key, max_batch_size=cfg.serve.max_batch_size, max_model_len=cfg.serve.max_model_len,
        dtype=cfg.model.dtype, startup_timeout=cfg.serve.startup_timeout, log_path=log_path,
    )


def vllm_server(cfg: Config, model_path: str, log_path: Path, **kw: Any):
    """vLLM serving the bf16 base (also for QLoRA: the nf4 copy is the trainer's) with room for rank lora_r."""
    from lightning_sdk.serving.vllm import VLLMServer

    s = cfg.serve
    return VLLMServer(model_path, served_model_name=cfg.model.name, lora_r=cfg.train.lora_r, host=s.host,
                      port=s.port, api_key=s.api_key, max_loras=s.max_loras, dtype=cfg.model.dtype,
                      max_model_len=s.max_model_len, gpu_memory_utilization=s.gpu_memory_utilization,
                      sleep_level=s.sleep_level, extra_args=s.extra_args, startup_timeout=s.startup_timeout,
                      log_path=log_path, **kw)


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
        self._server_generation, self._server_restarts, self._server_gone = 0, 0, None  # see _restart_server

    # The whole run, top to bottom.
    def run(self) -> RunState:
        cfg = self.cfg
        rollout_fn, reward_fn = load_agent(cfg.agent.module, cfg.agent.rollout, cfg.agent.reward)
        train_tasks = data.load(cfg.data.train, cfg.data.required_fields)
        eval_tasks = data.load(cfg.data.eval, cfg.data.required_fields) if cfg.data.eval else []
        self.credit_rule = credit.resolve(cfg.rollout.credit)
        model_path = models.resolve(cfg.model.name)  # before the run directory: bad input writes nothing
        checkpoint = self._prepare_run_dir()
        state = RunState()
        if checkpoint is not None:
            state = RunState(**json.loads((checkpoint / STATE).read_text()))
        self.store = Store(self.run_dir / "store.sqlite")
        abandoned = self.store.abandon_running()
        if abandoned:
            self.console.print(f"[yellow]{abandoned} rollout(s) left running by the previous process marked abandoned")
        self.store.add_tasks((data.task_id(t), t) for t in train_tasks + eval_tasks)
        tracing.install(self.store)
        self.metrics = MetricsLog(self.run_dir)
        self.metrics.rewrite(state.history)
        self.feed = TaskFeed(train_tasks, cfg.data.tasks_per_iteration, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        self.rollout_fn, self.reward_fn = rollout_fn, reward_fn

        from lightning_sdk.trainer import GRPOTrainer

        # One event loop for the whole run: clients an agent leaves open still close on the loop that made them.
        self._loop = asyncio.Runner()
        self._start_server(model_path, self.run_dir / "server.log")
        try:
            tracing.request_token_ids_from(self.server.base_url)
            self.trainer = GRPOTrainer(model_path, cfg.train, quantization=cfg.model.quantization,
                                       dtype=cfg.model.dtype, seed=cfg.run.seed)
            policy = self.server.served_model_name
            if checkpoint is not None:
                self.trainer.load_state(checkpoint / "trainer")
                policy = state.adapter_name
                self.server.load_adapter(policy, str(adapter_dir(checkpoint)))
                self.console.print(f"resumed {self.run_dir} after iteration {state.completed} ({checkpoint.name})")
            if eval_tasks and state.baseline_eval is None:
                state.baseline_eval = self._evaluate(eval_tasks, self.server.served_model_name, "untrained")
            for it in range(state.completed, cfg.run.iterations):
                policy = self._iteration(it, policy, state)
            final = self._evaluate(eval_tasks, policy, "trained") if eval_tasks else None
        finally:
            self.server.stop()
            self._loop.close()
            self.metrics.close()
            tracing.flush()
        self.metrics.plot(state.history, baseline=state.baseline_eval, final=final)
        self._print_table(state, final)
        self.final_eval = final
        return state

    def evaluate(self, tasks: list[dict], adapter: Path | None = None) -> float:
        """Score the base model, or the base with `adapter` (a PEFT directory), on `tasks`: `lightning eval`.

        Its spans go to a throwaway store, so evaluating never touches a run's own store or checkpoints.
        """
        cfg = self.cfg
        self.rollout_fn, self.reward_fn = load_agent(cfg.agent.module, cfg.agent.rollout, cfg.agent.reward)
        model_path = models.resolve(cfg.model.name)
        with tempfile.TemporaryDirectory(prefix="lightning-eval-") as tmp:
            self.store = Store(Path(tmp) / "store.sqlite")
            self.store.add_tasks((data.task_id(t), t) for t in tasks)
            tracing.install(self.store)
            self._loop = asyncio.Runner()
            self._start_server(model_path, Path(tmp) / "server.log")
            try:
                tracing.request_token_ids_from(self.server.base_url)
                policy = self.server.served_model_name
                if adapter is not None:
                    policy = f"{cfg.run.name}-eval"
                    self.server.load_adapter(policy, str(adapter))
                return self._evaluate(tasks, policy, "trained" if adapter is not None else "untrained")
            finally:
                self.server.stop()
                self._loop.close()
                tracing.flush()
                self.store.close()

    def _start_server(self, model_path: str, log_path: Path) -> None:
        with self.console.status("starting the inference server"):
            self.server = make_server(self.cfg, model_path, log_path)
            try:
                self.server.start()
            except ServerError as e:
                raise RunError(f"the inference server did not start: {e}") from None

    def _prepare_run_dir(self) -> Path | None:
        d = self.run_dir
        existing = d.exists() and any(d.iterdir())
        if existing and self.overwrite:
            shutil.rmtree(d)
            existing = False
        if existing and not self.resume:
            raise SetupError(f"run.dir {d} already holds a run; pass --resume to continue it, --overwrite to "
                           f"replace it, or --run-dir for a new one")
        d.mkdir(parents=True, exist_ok=True)
        return latest_checkpoint(d) if self.resume else None

    def _iteration(self, it: int, policy: str, state: RunState) -> str:
        cfg = self.cfg
        tasks = self.feed.batch_for(it)
        jobs = [RolloutJob(rollout_id=f"it{it:04d}-{i:03d}-{g}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                           group_id=f"{it}:{i}", task=t, iteration=it)
                for i, t in enumerate(tasks) for g in range(cfg.data.group_size)]
        t0 = time.perf_counter()
        results = self._collect(jobs, policy, f"iteration {it + 1}/{cfg.run.iterations} collect")
        collect_s = time.perf_counter() - t0
        ok = [r for r in results if r.status == "succeeded"]
        failed = len(results) - len(ok)
        if len(ok) < len(results) / 2:
            errors = sorted({r.error for r in results if r.error})[:3]
            raise RunError(f"iteration {it}: {failed} of {len(results)} rollouts failed; not training on the rest. "
                           f"First errors: {errors}. See `lightning traces --run-dir {self.run_dir}`.")
        transitions = self._transitions(ok)
        handover: dict[str, float] = {}  # sleep_s / wake_s: the server's GPU memory goes to the trainer meanwhile
        with self.console.status(f"iteration {it + 1}/{cfg.run.iterations} update: {len(transitions)} transitions"), \
                gpu_handover(self.server, handover):
            t1 = time.perf_counter()
            train_metrics = self.trainer.step(transitions)
            update_s = time.perf_counter() - t1
        rewards = [r.reward for r in ok]
        mean = sum(rewards) / len(rewards)
        row = {
            "iteration": it, "policy": policy, "reward_mean": mean,
            "reward_std": (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
            "rollouts": len(results), "failed": failed, "transitions": len(transitions),
            "completion_tokens": sum(len(t.completion_ids) for t in transitions),
            "collect_s": collect_s, "update_s": update_s, **handover,
            **{f"train.{k}": v for k, v in train_metrics.items()},
        }
        new_policy = f"{cfg.run.name}-iter{it + 1}"
        state.completed, state.adapter_name = it + 1, new_policy
        state.history.append(row)
        checkpoint = write_checkpoint(self.run_dir, it + 1, self.trainer, state)
        t2 = time.perf_counter()
        try:
            self.server.load_adapter(new_policy, str(adapter_dir(checkpoint)))
        except ServerError as e:
            if self._server_up():
                raise RunError(f"hot-loading {new_policy} from {checkpoint} failed: {e}") from None
            self._restart_server(new_policy)  # it died during the update; it comes back with the new adapter
        else:
            if policy != self.server.served_model_name:
                self.server.unload_adapter(policy)
        row["hotload_s"] = time.perf_counter() - t2
        self.metrics.log(row)
        self.console.print(f"iteration {it + 1}: reward {mean:.3f}  ({len(ok)} rollouts, {len(transitions)} "
                           f"transitions, collect {collect_s:.1f}s, update {update_s:.1f}s, "
                           f"hot-load {row['hotload_s']:.2f}s)")
        return new_policy

    def _transitions(self, ok: list[RolloutResult]) -> list[adapter.Transition]:
        tracing.flush()
        errors = tracing.writer_errors()
        if errors:
            raise RunError(f"the span writer failed, spans may be missing: {errors[0]}")
        out = []
        for r in ok:
            record = self.store.rollout(r.job.rollout_id)
            out += adapter.to_transitions(record, self.store.spans(r.job.rollout_id), credit=self.credit_rule,
                                          components=self.cfg.rollout.components,
                                          error_reward=self.cfg.rollout.error_reward)
        if not out:
            raise adapter.CaptureError(
                f"no transitions from {len(ok)} rollouts: none of their LLM calls is in rollout.components = "
                f"{self.cfg.rollout.components}")
        return out

    def _collect(self, jobs: list[RolloutJob], policy: str, label: str) -> list[RolloutResult]:
        if self.cfg.run.runtime == "ray":
            results = self.server.collect(jobs, policy, store=self.store, label=label, console=self.console)
        else:
            results = self._collect_embedded(jobs, policy, label)
        bad = [r for r in results if r.failed_in == "reward"]
        if bad and self.cfg.rollout.on_reward_error == "stop":
            raise RunError(f"{len(bad)} rollout(s) got no usable reward and rollout.on_reward_error = 'stop'; "
                           f"first: {bad[0].error}")
        return results

    def _collect_embedded(self, jobs: list[RolloutJob], policy: str, label: str) -> list[RolloutResult]:
        llm = LLM(base_url=self.server.base_url, api_key=self.server.api_key or "EMPTY", model=policy)
        restart_lock = asyncio.Lock()

        async def server_lost(generation: int) -> bool:
            """After a failed rollout: did the server die under it? If it is down, restart it (once for all)."""
            async with restart_lock:
                if self._server_generation != generation:
                    return True  # it died and came back while this rollout ran
                if await asyncio.to_thread(self._server_up):
                    return False
                await asyncio.to_thread(self._restart_server, policy)
                return True

        async def go() -> list[RolloutResult]:
            gate = asyncio.Semaphore(self.cfg.rollout.concurrency)
            with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=self.console, transient=True) as progress:
                bar = progress.add_task(label, total=len(jobs))

                async def attempt(job: RolloutJob) -> RolloutResult:
                    async with gate:
                        return await run_rollout(job, rollout_fn=self.rollout_fn, reward_fn=self.reward_fn,
                                                 llm=llm, store=self.store, timeout=self.cfg.rollout.timeout)

                async def one(job: RolloutJob) -> RolloutResult:
                    generation = self._server_generation
                    result = await attempt(job)
                    if result.status == "failed" and await server_lost(generation):
                        # Not the agent's fault: run it once more on the restarted server, as a new attempt.
                        retry = dataclasses.replace(job, rollout_id=f"{job.rollout_id}-r2", attempt=2)
                        self.store.abandon(job.rollout_id, f"the inference server died during the rollout; re-run "
                                                           f"as {retry.rollout_id} ({result.error})")
                        result = await attempt(retry)
                    progress.advance(bar)
                    return result

                return await asyncio.gather(*(one(j) for j in jobs))

        return self._loop.run(go())

    def _server_up(self) -> bool:
        if not self.server.is_alive():
            return False
        try:  # a process that is alive but refuses connections is as good as dead; a slow answer is not
            httpx.get(self.server.base_url.removesuffix("/v1") + "/health", timeout=30)
        except httpx.TransportError as e:
            return isinstance(e, httpx.TimeoutException)
        return True

    def _restart_server(self, policy: str) -> None:
        if self._server_gone is not None:  # other rollouts saw it die too: one failed restart is enough
            raise self._server_gone
        self._server_restarts += 1
        if self._server_restarts > MAX_SERVER_RESTARTS:
            raise RunError(f"the inference server died {self._server_restarts} times; not restarting it again. "
                           f"Log {self.run_dir / 'server.log'}:\n{self.server.log_tail(40)}")
        self.console.print(f"[yellow]the inference server died; restarting it (restart {self._server_restarts} of "
                           f"at most {MAX_SERVER_RESTARTS}) and re-running the rollouts it took down")
        try:
            self.server.stop()
            self.server.start()
            if policy != self.server.served_model_name:
                # A trained policy is always the adapter of the newest checkpoint (hot-loaded right after it).
                self.server.load_adapter(policy, str(adapter_dir(latest_checkpoint(self.run_dir))))
        except ServerError as e:
            self._server_gone = RunError(f"the inference server died and did not come back: {e}")
            raise self._server_gone from None
        self._server_generation += 1

    def _evaluate(self, tasks: list[dict], policy: str, label: str) -> float:
        phase_it = 0 if label == "untrained" else self.cfg.run.iterations
        jobs = [RolloutJob(rollout_id=f"eval-{label}-{i:04d}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                           group_id=f"eval:{label}:{i}", task=t, iteration=phase_it, phase="eval")
                for i, t in enumerate(tasks)]
        results = self._collect(jobs, policy, f"eval ({label})")
        scores = [r.reward if r.reward is not None else 0.0 for r in results]  # a failed rollout scores 0
        mean = sum(scores) / len(scores)
        self.console.print(f"eval ({label}, {policy}): mean reward {mean:.3f} over {len(scores)} tasks")
        return mean

    def _print_table(self, state: RunState, final: float | None) -> None:
        table = Table(title=f"{self.cfg.run.name}: reward per iteration")
        for col in ("iter", "policy", "reward", "± std", "failed", "transitions", "loss", "kl", "logprob gap",
                    "collect s", "update s"):
            table.add_column(col, justify="right")
        if state.baseline_eval is not None:
            table.add_row("eval", "untrained", f"{state.baseline_eval:.3f}", "", "", "", "", "", "", "", "",
                          style="dim")
        for row in state.history:
            table.add_row(str(row["iteration"] + 1), row["policy"], f"{row['reward_mean']:.3f}",
                          f"{row['reward_std']:.3f}", str(row["failed"]), str(row["transitions"]),
                          _fmt(row.get("train.loss")), _fmt(row.get("train.kl")),
                          _fmt(row.get("train.logprob_gap")), f"{row['collect_s']:.1f}", f"{row['update_s']:.1f}")
        if final is not None:
            table.add_row("eval", "trained", f"{final:.3f}", "", "", "", "", "", "", "", "", style="bold green")
        self.console.print(table)
        self.console.print(f"run directory: {self.run_dir}  (metrics.jsonl, reward_curve.png, tensorboard/, "
                           f"store.sqlite, checkpoints/)")


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"
