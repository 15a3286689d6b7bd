"""How rollouts run is a strategy: one `Collector` protocol, one implementation per runtime (`run.runtime`).

A collector owns the inference server(s) its rollouts call and starts the run's gateway in front of them (the
one address agents get: gateway/proxy.py), runs a phase's jobs and returns one result per job, in order; the
runtime loop calls only this interface. Each implementation is imported only when chosen, so Ray is imported
only by the Ray runtime.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lightning_sdk.config import Config
from lightning_sdk.console import live_shown
from lightning_sdk.errors import SetupError
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.servers import InferenceServer
from lightning_sdk.gateway.isolated import IsolatedGateway
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.store import Store


@dataclass(frozen=True)
class Agent:
    """The user's two functions, as `agent.load_agent` found them in `module`."""

    module: str
    rollout_fn: Callable
    reward_fn: Callable


class Collector(Protocol):
    server: InferenceServer  # where the policy is served; started by start(), stopped by stop()
    gateway: Gateway | IsolatedGateway  # what agents call; start() starts it in front of the server (the runtime
    # made it and stops it)

    def start(self) -> None: ...
    def stop(self) -> None: ...

    def collect(self, jobs: list[RolloutJob], policy: str, *, label: str) -> list[RolloutResult]:
        """Run every job against `policy`; a job whose infrastructure failed under it is re-run once as
        `job.retry()` (the first attempt marked abandoned, its spans kept)."""

    def hot_load(self, name: str, adapter: Path, *, previous: str | None = None) -> None:
        """Serve the adapter at `adapter` as `name` from now on, and drop the `previous` adapter (never the base)."""


# run.runtime -> "module:class", imported on demand.
RUNTIMES = {
    "embedded": "lightning_sdk.rollouts.embedded:EmbeddedCollector",
    "ray": "lightning_sdk.rollouts.ray:RayCollector",
    "remote": "lightning_sdk.rollouts.remote.collect:RemoteCollector",
    "processes": "lightning_sdk.rollouts.processes:ProcessesCollector",
}


def collector_class(runtime: str) -> type:
    module, _, name = RUNTIMES[runtime].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise SetupError(f"run.runtime = {runtime!r} needs {e.name or e}: pip install "
                         f"'lightning-agent-rl[{runtime}]' ({e})") from None


def runs_agent(runtime: str) -> bool:
    """Whether this runtime runs the agent in this run's processes, so the runtime imports its module: a collector
    class whose agent runs elsewhere (remote workers, in their own environment) says `runs_agent = False`."""
    return getattr(collector_class(runtime), "runs_agent", True)


def gateway_apart(runtime: str) -> bool:
    """Whether this runtime's agents run in the run's own process, so the gateway serves from a process of its own
    (gateway/isolated.py): a collector class says `gateway_apart = True`."""
    return getattr(collector_class(runtime), "gateway_apart", False)


def make_collector(cfg: Config, *, agent: Agent | None, gateway: Gateway | IsolatedGateway, model_path: str,
                   store: Store, log_dir: Path, console: Console, server: InferenceServer | None = None) -> Collector:
    """The runtime's collector; `server`: a running one it borrows instead of starting its own (servers.lent; not
    with run.runtime = "ray", whose collector places its own servers)."""
    cls = collector_class(cfg.run.runtime)
    lent = {} if server is None else {"server": server}
    if lent and cfg.run.runtime == "ray":
        raise ValueError("run.runtime = 'ray' starts its own inference servers: it cannot borrow one")
    return cls(cfg, agent=agent, gateway=gateway, model_path=model_path, store=store, log_dir=log_dir,
               console=console, **lent)


@contextmanager
def progress_bar(console: Console, label: str, total: int) -> Iterator[Callable[[], None]]:
    """A transient progress bar for one phase; yields the function that advances it by one rollout. Where it cannot
    show (a log, a pipe, a notebook without ipywidgets: console.live_shown) there is none."""
    if not live_shown(console):
        yield lambda: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bar = progress.add_task(label, total=total)
        yield lambda: progress.advance(bar)
