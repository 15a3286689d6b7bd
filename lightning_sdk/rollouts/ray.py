"""The Ray runtime (`run.runtime = "ray"`): rollout workers and inference servers as Ray actors, one store.

What runs where (docs/scaling.md has the picture):
- driver (head node): the `Runtime` loop, the trainer, the SQLite store it reads, the gateway (gateway/proxy.py:
  least-loaded over the server actors, on serve.host) and a `_StoreWriter` actor pinned to the head that is the
  only writer of rollout rows and spans;
- `_ServerActor`s (spread over nodes, each with its CPUs and GPU set reserved in a placement group): each runs one
  inference server, built-in or vLLM, behind the gateway; every adapter is hot-loaded into every one;
- `_RolloutWorker`s (spread over nodes): run the user's `@rollout`/`@reward` with tracing installed. Each span is
  shipped to the writer as soon as it ends, so what a worker wrote before it died is kept.

If a worker dies mid-collection, its unfinished rollouts are marked abandoned (spans kept) and re-run once more
on a live worker under a new rollout id with attempt + 1; the dead worker is replaced before the next phase.
The writer ignores late rows for a rollout it has abandoned, so no rollout is counted twice.
Ray is imported only here, and only when this runtime is chosen (rollouts.collector.RUNTIMES).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from rich.console import Console

from lightning_sdk import tracing
from lightning_sdk.agent import LLM, load_agent, run_environment
from lightning_sdk.config import Config
from lightning_sdk.constraint import ServerGrammar
from lightning_sdk.errors import RunError, SetupError
from lightning_sdk.rollouts.collector import Agent, progress_bar
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.servers import ServerError
from lightning_sdk.servers.process import control_request, new_api_key
from lightning_sdk.servers.select import resolved_backend, server_seed, vllm_server
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.store import Store


# --------------------------------------------------------------------------------------------------- actors

class _StoreWriter:
    """Owns the head's write connection for everything workers produce; runs tasks one at a time, in order."""

    def __init__(self, path: str):
        self.store = Store(path)
        self.abandoned: set[str] = set()

    def start_rollout(self, rollout_id: str, kw: dict) -> None:
        if rollout_id not in self.abandoned:
            self.store.start_rollout(rollout_id, **kw)

    def finish_rollout(self, rollout_id: str, kw: dict) -> None:
        if rollout_id not in self.abandoned:  # a dead worker's late result must not count
            self.store.finish_rollout(rollout_id, **kw)

    def write_spans(self, records: list) -> None:
        self.store.write_spans(records)

    def abandon(self, rollout_id: str, error: str) -> bool:
        """True if the rollout had started: its row is marked abandoned and a late result of it ignored. One that
        never started is run again under the same id (`RayCollector.collect`), so its id stays open."""
        started = self.store.abandon(rollout_id, error)
        if started:
            self.abandoned.add(rollout_id)
        return started


class _ShippedStore:
    """The `Store` surface `run_rollout` and the span processor use, forwarded to the writer actor."""

    def __init__(self, writer: Any):
        self.writer = writer
        self._refs: list = []

    def start_rollout(self, rollout_id: str, **kw: Any) -> None:
        self._refs.append(self.writer.start_rollout.remote(rollout_id, kw))

    def finish_rollout(self, rollout_id: str, **kw: Any) -> None:
        self._refs.append(self.writer.finish_rollout.remote(rollout_id, kw))

    def write_spans(self, records) -> None:  # from tracing's writer thread: blocking is fine there
        ray.get(self.writer.write_spans.remote(list(records)))

    async def settle(self) -> None:
        refs, self._refs = self._refs, []
        await asyncio.gather(*refs)


class _RolloutWorker:
    def __init__(self, module: str, rollout: str | None, reward: str | None, writer: Any, timeout: float,
                 endpoint: tuple[str, str], redirect_openai: bool):
        # This actor's process is the agent's for the run: its environment stays pointed at the gateway (held here:
        # a context manager left to the garbage collector would restore it at once).
        self._environment = run_environment(*endpoint, redirect_openai=redirect_openai)
        self._environment.__enter__()
        self.rollout_fn, self.reward_fn = load_agent(module, rollout, reward)
        self.sink = _ShippedStore(writer)
        self.timeout = timeout
        tracing.install(self.sink, gateway_url=endpoint[0])

    async def run(self, job: RolloutJob, base_url: str, api_key: str, model: str) -> RolloutResult:
        result = await run_rollout(job, rollout_fn=self.rollout_fn, reward_fn=self.reward_fn,
                                   llm=LLM(base_url=base_url, api_key=api_key, model=model), store=self.sink,
                                   timeout=self.timeout)
        await asyncio.to_thread(tracing.flush)  # this rollout's spans are in the store before we say done
        await self.sink.settle()
        return result

    def ready(self) -> bool:
        return True


class _ServerActor:
    """One inference server (a replica: built-in or vLLM, made unstarted by the driver) in this actor's process, so
    on this actor's node and GPUs (Ray sets CUDA_VISIBLE_DEVICES, which the server's process inherits)."""

    def __init__(self, server: Any, local: bool):
        self.server = server
        if not local:
            self.server.host = ray.util.get_node_ip_address()

    def start(self) -> str:
        self.server.start()
        return self.server.url

    def stop(self) -> None:
        self.server.stop()

    def log_tail(self, n: int) -> str:
        return self.server.log_tail(n)


# ------------------------------------------------------------------------------------------------ the servers

class RayServers:
    """Inference-server actors: an `InferenceServer` to the runtime (adapter loads go to each of them)."""

    def __init__(self, cfg: Config, model_path: str, log_dir: Path):
        self.cfg, self.rc = cfg, cfg.ray
        self.model_path, self.log_dir = model_path, Path(log_dir)
        self.served_model_name = cfg.model.name
        self.api_key = new_api_key()  # every server actor checks it; agents reach them only through the gateway
        self.urls: list[str] = []
        self.actors: list = []
        self.group: Any = None
        self._started_ray = False

    def start(self) -> None:
        rc = self.rc
        if not ray.is_initialized():
            if rc.address:
                ray.init(address=rc.address, log_to_driver=False)
            else:
                ray.init(num_cpus=rc.num_cpus, object_store_memory=rc.object_store_memory, include_dashboard=False,
                         log_to_driver=False)
            self._started_ray = True
        need = rc.servers * rc.cpus_per_server + rc.num_workers * rc.cpus_per_worker
        have = ray.cluster_resources().get("CPU", 0)
        if need > have:
            self.stop()
            raise SetupError(f"ray: ray.servers x ray.cpus_per_server + ray.num_workers x ray.cpus_per_worker = "
                             f"{need:g} CPUs, but the Ray cluster has {have:g}; lower them or add nodes")
        gpus = rc.gpus_per_server
        # Each replica's CPUs and GPUs are reserved together (a GPU set per replica), spread over the nodes.
        self.group = placement_group([{"CPU": rc.cpus_per_server, **({"GPU": gpus} if gpus else {})}] * rc.servers,
                                     strategy="SPREAD")
        if not self.group.wait(timeout_seconds=60):
            self.stop()
            raise SetupError(f"ray: no room for {rc.servers} server(s) of ray.cpus_per_server = {rc.cpus_per_server:g}"
                             f" and ray.gpus_per_server = {gpus:g} in the Ray cluster")
        self.actors = [ray.remote(_ServerActor).options(
            num_cpus=rc.cpus_per_server, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=i)).remote(self.replica(i), rc.address is None)
            for i in range(rc.servers)]
        try:
            self.urls = ray.get([a.start.remote() for a in self.actors])
        except ray.exceptions.RayError as e:
            self.stop()
            raise ServerError(f"an inference server actor failed to start: {e}") from e

    def replica(self, i: int) -> Any:
        """Server i, unstarted, on 127.0.0.1 (its actor's node IP on a cluster), with the replicas' shared key and a
        sampler stream of its own (a group's rollouts on two replicas never share samples)."""
        log = self.log_dir / f"server-{i}.log"
        if resolved_backend(self.cfg) == "vllm":
            seed = ["--seed", str(i)] if i and "--seed" not in self.cfg.serve.extra_args else []
            return vllm_server(self.cfg, self.model_path, log, api_key=self.api_key, more_args=seed)
        from lightning_sdk.servers.cpu import CPUServer

        s = self.cfg.serve
        return CPUServer(self.model_path, served_model_name=self.served_model_name, api_key=self.api_key,
                         max_batch_size=s.max_batch_size, max_model_len=s.max_model_len, dtype=self.cfg.model.dtype,
                         quantization=self.cfg.model.quantization, threads=max(1, int(self.rc.cpus_per_server)),
                         startup_timeout=s.startup_timeout, log_path=log,
                         seed=(server_seed(self.cfg) + i) % 2**32, tool_call_parser=s.tool_call_parser,
                         reasoning_parser=s.reasoning_parser)

    @property
    def grammar(self) -> ServerGrammar:
        """What the server actors apply to a constraint (each is `replica(i)`, from one config)."""
        return self.replica(0).grammar

    def stop(self) -> None:
        if self.actors:  # stop the server subprocesses before their actors go
            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=30)
            except ray.exceptions.RayError:
                pass
            for a in self.actors:
                ray.kill(a)
            self.actors, self.urls = [], []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def is_alive(self) -> bool:
        return bool(self.urls)

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        # Every server reads `path` itself: on several nodes, run.dir must be on storage they all see.
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": replace})

    def unload_adapter(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def log_tail(self, n: int = 50) -> str:
        try:
            return "\n".join(ray.get([a.log_tail.remote(n) for a in self.actors], timeout=10))
        except ray.exceptions.RayError as e:
            return f"(server logs unavailable: {e})"

    def _post(self, route: str, body: dict) -> None:
        """`route` on every server at once; the first failure raises (ServerError), once all have answered."""
        with ThreadPoolExecutor(len(self.urls)) as pool:
            done = [pool.submit(control_request, "POST", f"{u}{route}", api_key=self.api_key,
                                who=f"inference server {u}", json=body) for u in self.urls]
        for f in done:
            f.result()


# ------------------------------------------------------------------------------------------------ the collector

class RayCollector:
    """Rollout-worker actors and the head's store writer, calling `RayServers`; see the module docstring."""

    def __init__(self, cfg: Config, *, agent: Agent, gateway: Gateway, model_path: str, store: Store, log_dir: Path,
                 console: Console):
        self.cfg, self.rc, self.gateway, self.store, self.console = cfg, cfg.ray, gateway, store, console
        self.server = RayServers(cfg, model_path, log_dir)
        self.token = uuid.uuid4().hex[:8]
        self.workers: list = []
        self._worker_names: list[str] = []
        self.writer = None
        self._names = itertools.count()

    def start(self) -> None:
        self.server.start()
        self.gateway.start(self.server.urls, backend_key=self.server.api_key,
                           grammar=self.server.grammar)

    def stop(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers, self._worker_names = [], []
        if self.writer is not None:
            ray.kill(self.writer)
            self.writer = None
        self.server.stop()

    def hot_load(self, name: str, adapter: Path, *, previous: str | None = None) -> None:
        try:
            self.server.load_adapter(name, str(adapter))
            if previous not in (None, name, self.server.served_model_name):
                self.server.unload_adapter(previous)
        except ServerError as e:
            raise RunError(f"hot-loading {name} from {adapter} failed: {e}") from None

    def _ensure_workers(self) -> None:
        rc = self.rc
        if self.writer is None:
            head = ray.get_runtime_context().get_node_id()
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            self.writer = ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))(
                _StoreWriter).remote(str(self.store.path))
        per = rc.worker_concurrency or max(1, -(-self.cfg.rollout.concurrency // rc.num_workers))
        actor = ray.remote(num_cpus=rc.cpus_per_worker, max_concurrency=per, max_restarts=0,
                           scheduling_strategy="SPREAD")(_RolloutWorker)
        a = self.cfg.agent
        while len(self.workers) < rc.num_workers:  # tops up workers that died in an earlier phase
            name = f"lightning-rollout-{self.token}-{next(self._names)}"
            self.workers.append(actor.options(name=name).remote(
                a.module, a.rollout, a.reward, self.writer, self.cfg.rollout.timeout,
                (self.gateway.base_url, self.gateway.api_key), a.redirect_openai))
            self._worker_names.append(name)
        ray.get([w.ready.remote() for w in self.workers])

    def collect(self, jobs: list[RolloutJob], policy: str, *, label: str) -> list[RolloutResult]:
        self._ensure_workers()
        live = list(zip(self.workers, self._worker_names))
        results: dict[int, RolloutResult] = {}
        pending: dict[Any, tuple[int, RolloutJob, Any]] = {}
        turn = itertools.count()
        api_key = self.gateway.api_key

        def submit(i: int, job: RolloutJob, avoid: Any = None) -> None:
            choices = [w for w, _ in live if w is not avoid] or [w for w, _ in live]
            if not choices:
                raise RunError("every rollout worker has died")
            w = choices[next(turn) % len(choices)]
            self.gateway.rollouts.open(job.trace_id, job.rollout_id, job.attempt, job.phase, seed=job.seed)
            base_url = self.gateway.rollout_base_url(job.trace_id)  # attributed whatever transport the agent's is
            pending[w.run.remote(job, base_url, api_key, policy)] = (i, job, w)

        with progress_bar(self.console, label, len(jobs)) as advance:
            for i, job in enumerate(jobs):
                submit(i, job)
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    i, job, w = pending.pop(ref)
                    self.gateway.rollouts.close(job.trace_id)
                    try:
                        results[i] = ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        self._worker_died(w, live)
                        reason = f"rollout worker died: {str(e).splitlines()[0][:200]}"
                        started = ray.get(self.writer.abandon.remote(job.rollout_id, reason))
                        if live and not started and job.attempt == 1:
                            submit(i, job)  # it never began: not an attempt
                            continue
                        if live and job.attempt <= self.rc.max_retries:
                            submit(i, job.retry(), avoid=w)
                            continue
                        results[i] = RolloutResult(job, "failed", None, None, reason)
                    except ray.exceptions.RayError as e:
                        results[i] = RolloutResult(job, "failed", None, None, f"{type(e).__name__}: {e}")
                    advance()
        return [results[i] for i in range(len(jobs))]

    def _worker_died(self, w: Any, live: list) -> None:
        for k, (x, name) in enumerate(live):
            if x is w:
                del live[k]
                self.console.print(f"[yellow]rollout worker {name} died; re-running its rollouts on the others")
                break
        for k, x in enumerate(self.workers):
            if x is w:
                del self.workers[k]
                del self._worker_names[k]
                break
