"""The embedded runtime: rollouts run as asyncio tasks in this process, against one inference server.

At most `rollout.concurrency` rollouts run at once (sync agents each in a thread of their own, see
`rollouts.worker`). A rollout that failed because the server died under it is not the agent's fault: the server
is restarted (once for all the rollouts it took down, at most MAX_SERVER_RESTARTS per run) with the policy it
served, and the rollout is re-run once as a new attempt.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from pathlib import Path

from rich.console import Console

from lightning_sdk.agent import LLM
from lightning_sdk.config import Config
from lightning_sdk.errors import RunError
from lightning_sdk.rollouts.collector import Agent, progress_bar
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.servers import InferenceServer, ServerError
from lightning_sdk.gateway.isolated import IsolatedGateway
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.select import make_server
from lightning_sdk.store import Store

MAX_SERVER_RESTARTS = 3  # per run: a server that keeps dying is a bug to fix, not to retry forever
_loop: asyncio.Runner | None = None


def _event_loop() -> asyncio.Runner:
    """One event loop for every phase of every run in this process. Async clients bind their connection pools to
    the loop that first used them: a client an agent keeps across phases, and clients libraries cache for the
    whole process (the Agents SDK's shared httpx client, used by its default model), stay usable only on that
    loop; a second run in a notebook would find them bound to a closed one."""
    global _loop
    if _loop is None:
        _loop = asyncio.Runner()
        atexit.register(_loop.close)
    return _loop


class EmbeddedCollector:
    gateway_apart = True  # its agents hold this process's GIL: the gateway serves from a process of its own

    def __init__(self, cfg: Config, *, agent: Agent, gateway: Gateway | IsolatedGateway, model_path: str,
                 store: Store, log_dir: Path, console: Console, server: InferenceServer | None = None):
        self.cfg, self.agent, self.gateway, self.store, self.console = cfg, agent, gateway, store, console
        self.log_path = Path(log_dir) / "server.log"
        # `server`: one already running that this collector borrows (servers.lent), else its own
        self.server = server if server is not None else make_server(cfg, model_path, self.log_path)
        self._adapters: dict[str, Path] = {}  # policies hot-loaded and still served: reloaded after a restart
        self._generation, self._restarts, self._gone = 0, 0, None  # see _restart
        # A pipelined run hot-loads from its update thread while rollouts may be restarting the server.
        self._server_lock = threading.RLock()

    def start(self) -> None:
        self.server.start()
        self.gateway.start(self.server.urls, backend_key=self.server.api_key,
                           grammar=self.server.grammar)  # a restart keeps the server's port

    def stop(self) -> None:
        self.server.stop()

    def hot_load(self, name: str, adapter: Path, *, previous: str | None = None) -> None:
        with self._server_lock:
            self._hot_load(name, adapter, previous)

    def _hot_load(self, name: str, adapter: Path, previous: str | None) -> None:
        self._adapters[name] = Path(adapter)
        try:
            self.server.load_adapter(name, str(adapter))
        except ServerError as e:
            if self._server_up():
                raise RunError(f"hot-loading {name} from {adapter} failed: {e}") from None
            self._adapters.pop(previous, None)
            self._restart()  # it died during the update; it comes back serving the new adapter
            return
        if previous not in (None, name, self.server.served_model_name):
            self.server.unload_adapter(previous)
            self._adapters.pop(previous, None)

    def collect(self, jobs: list[RolloutJob], policy: str, *, label: str) -> list[RolloutResult]:
        timeout = self.cfg.rollout.timeout

        async def go() -> list[RolloutResult]:
            gate = asyncio.Semaphore(self.cfg.rollout.concurrency)
            restart_lock = asyncio.Lock()

            async def server_lost(generation: int) -> bool:
                """After a failed rollout: did the server die under it? If it is down, restart it (once for all)."""
                async with restart_lock:
                    if self._generation != generation:
                        return True  # it died and came back while this rollout ran
                    if await asyncio.to_thread(self._server_up):
                        return False
                    await asyncio.to_thread(self._restart)
                    return True

            async def attempt(job: RolloutJob) -> RolloutResult:
                async with gate:
                    self.gateway.rollouts.open(job.trace_id, job.rollout_id, job.attempt, job.phase, seed=job.seed)
                    # The rollout's own base URL: a client whose transport no trace context reaches (DSPy 3.4's
                    # native one) is attributed all the same.
                    llm = LLM(base_url=self.gateway.rollout_base_url(job.trace_id), api_key=self.gateway.api_key,
                              model=policy)
                    try:
                        return await run_rollout(job, rollout_fn=self.agent.rollout_fn,
                                                 reward_fn=self.agent.reward_fn, llm=llm, store=self.store,
                                                 timeout=timeout)
                    finally:
                        self.gateway.rollouts.close(job.trace_id)

            with progress_bar(self.console, label, len(jobs)) as advance:
                async def one(job: RolloutJob) -> RolloutResult:
                    generation = self._generation
                    result = await attempt(job)
                    if result.status == "failed" and isinstance(self.gateway, IsolatedGateway):
                        down = self.gateway.why_down()  # its rollouts fail or time out: the cause is named instead
                        if down is not None:
                            raise RunError(down)
                    if result.status == "failed" and await server_lost(generation):
                        retry = job.retry()
                        self.store.abandon(job.rollout_id, f"the inference server died during the rollout; re-run "
                                                           f"as {retry.rollout_id} ({result.error})")
                        result = await attempt(retry)
                    advance()
                    return result

                tasks = [asyncio.ensure_future(one(j)) for j in jobs]
                try:
                    return await asyncio.gather(*tasks)
                except BaseException:
                    # The run stops on this error: the other rollouts end here, before the store closes, not as
                    # tracebacks when the loop shuts down.
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise

        return _event_loop().run(go())

    def _server_up(self) -> bool:
        return self.server.answers()

    def _restart(self) -> None:
        with self._server_lock:
            self._restart_server()

    def _restart_server(self) -> None:
        if self._gone is not None:  # other rollouts saw it die too: one failed restart is enough
            raise self._gone
        self._restarts += 1
        if self._restarts > MAX_SERVER_RESTARTS:
            raise RunError(f"the inference server died {self._restarts} times; not restarting it again. "
                           f"Log {self.log_path}:\n{self.server.log_tail(40)}")
        self.console.print(f"[yellow]the inference server died; restarting it (restart {self._restarts} of "
                           f"at most {MAX_SERVER_RESTARTS}) and re-running the rollouts it took down")
        try:  # with replicas, only those that died: the others serve meanwhile
            self.server.restart(self._adapters)
        except ServerError as e:
            self._gone = RunError(f"the inference server died and did not come back: {e}")
            raise self._gone from None
        self._generation += 1
