"""A run's live services, set up and torn down in one place: the gateway every agent calls, the agent, tracing
into the store, and the collector with its inference server. The open `Session` also says which adapter serves
each policy (the gateway's routing) and collects rollouts under it. `lightning run`, `lightning eval` and
`lightning check` all open one."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from lightning_sdk import data, models, tracing
from lightning_sdk.agent import load_agent, run_environment
from lightning_sdk.config import Config, policies
from lightning_sdk.console import printable, status
from lightning_sdk.errors import RunError, SetupError
from lightning_sdk.failures import first_line, summary
from lightning_sdk.gateway.isolated import IsolatedGateway
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.rollouts.collector import Agent, Collector, gateway_apart, make_collector, runs_agent
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.rollouts.remote.protocol import previous_port
from lightning_sdk.servers import InferenceServer, ServerError
from lightning_sdk.servers.process import new_api_key
from lightning_sdk.store import Store
from lightning_sdk.train.checkpoint import adapter_dir, policy_adapters


class Session:
    """The open collector (its server and gateway) and store, and the adapters each policy is served by."""

    def __init__(self, cfg: Config, console: Console, collector: Collector, store: Store, credit_rule: Any):
        self.cfg, self.console, self.collector, self.store, self.credit_rule = cfg, console, collector, store, credit_rule
        self.policies = policies(cfg)
        self.multi = bool(cfg.policies)  # one adapter per policy, each call served by its component's

    @property
    def base(self) -> str:
        """The base model's served name."""
        return self.collector.server.served_model_name

    def label(self, policy: dict[str, str]) -> str:
        """The served adapters as one line: the adapter's name, or `policy=adapter` for each of several."""
        return ", ".join(f"{k}={v}" for k, v in policy.items()) if self.multi else policy[self.cfg.run.name]

    def trained_names(self, n: int) -> dict[str, str]:
        """Each policy's adapter as update n saves and serves it."""
        run = self.cfg.run.name
        return {p.name: f"{run}-{p.name}-iter{n}" if self.multi else f"{run}-iter{n}" for p in self.policies}

    def trained_components(self) -> list[str]:
        """The components whose calls become transitions (empty: all)."""
        return [c for p in self.policies for c in p.components]

    def adapter_paths(self, checkpoint: Path) -> dict[str, Path]:
        """Each policy's adapter directory in `checkpoint`."""
        return policy_adapters(checkpoint) if self.multi else {self.cfg.run.name: adapter_dir(checkpoint)}

    def hot_load(self, policy: dict[str, str], checkpoint: Path, retire: dict[str, str] | None = None) -> None:
        """Each of `policy`'s adapters from `checkpoint` into the server, each loaded before the `retire`d one of
        its policy is dropped."""
        paths = self.adapter_paths(checkpoint)
        for name, served in policy.items():
            self.collector.hot_load(served, paths[name], previous=(retire or {}).get(name))

    def route(self, policy: dict[str, str]) -> None:
        """Serve every call by `policy` (each policy's adapter) from now on: with [policies] each call by its
        component's policy, the components in no policy by the base model."""
        if self.multi:
            self.collector.gateway.route(self.base, {c: policy[p.name] for p in self.policies for c in p.components})
        else:  # whatever model name the agent asks for
            self.collector.gateway.route(policy[self.cfg.run.name], {})

    def routed(self) -> dict[str, str]:
        """The adapters the gateway serves now, by policy."""
        gateway = self.collector.gateway
        if not self.multi:
            return {self.cfg.run.name: gateway.policy}
        return {p.name: gateway.by_component.get(p.components[0], gateway.policy) for p in self.policies}

    def collect(self, jobs: list[RolloutJob], policy: dict[str, str] | None, label: str) -> list[RolloutResult]:
        """`jobs` run under `policy` (None: however the gateway routes meanwhile)."""
        if policy is not None:
            self.route(policy)
        results = self.collector.collect(jobs, self.collector.gateway.policy, label=label)
        bad = [r for r in results if r.failed_in == "reward"]
        if bad and self.cfg.rollout.on_reward_error == "stop":
            raise RunError(f"{len(bad)} rollout(s) got no usable reward and rollout.on_reward_error = 'stop'; "
                           f"first: {printable(first_line(bad[0].error or ''), 2000)}")
        return results

    def failures(self, results: list[RolloutResult]) -> str:
        """The failed rollouts among `results` in one line (failures.summary, with the user's line that raised from
        the stored traceback); "" when none failed."""
        failed = [r for r in results if r.status != "succeeded"]
        records = {r.job.rollout_id: self.store.rollout(r.job.rollout_id) for r in failed}
        return summary((r.error, getattr(records[r.job.rollout_id], "traceback", None)) for r in failed)


def bind_gateway(cfg: Config, stack: ExitStack, run_dir: Path, *, resume: bool) -> Gateway | IsolatedGateway:
    """The run's gateway, bound (serve.host/serve.port: a SetupError naming the key if it cannot be), and the
    agent process's environment pointing at it (agent.redirect_openai) until `stack` closes: set before the agent
    module is imported, so OpenAI clients it builds at import time call the run's server too. Where the agents run
    in this process, it serves from a process of its own (gateway/isolated.py)."""
    api_key = cfg.serve.api_key or new_api_key()
    kind = IsolatedGateway if gateway_apart(cfg.run.runtime) else Gateway

    def listen(port: int) -> Gateway | IsolatedGateway:
        return kind(host=cfg.serve.host, port=port, api_key=api_key, model_names=cfg.serve.model_names,
                    store_text=cfg.serve.store_text)

    gateway = None
    if resume and cfg.serve.port == 0 and (port := previous_port(run_dir)):
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


def agent_of(cfg: Config) -> Agent | None:
    """The agent's functions; None where the runtime's workers run it (they import it, this process never)."""
    a = cfg.agent
    if not runs_agent(cfg.run.runtime):
        return None
    rollout_fn, reward_fn = load_agent(a.module, a.rollout, a.reward)
    return Agent(a.module, rollout_fn, reward_fn)


@contextmanager
def open_session(cfg: Config, console: Console, agent: Agent | None, gateway: Gateway | IsolatedGateway,
                 model_path: str, store: Store, log_dir: Path, credit_rule: Any,
                 server: InferenceServer | None = None) -> Iterator[Session]:
    """Tracing into `store`, and the collector (its inference server, the gateway in front) started; all undone on
    exit. `server`: a running one to borrow (servers.lent) instead of starting one."""
    tracing.install(store, gateway_url=gateway.base_url, otlp_endpoint=cfg.run.otlp_endpoint)
    gateway.capture.record_to(store)
    gateway.capture.exported = tracing.export_received
    collector = make_collector(cfg, agent=agent, gateway=gateway, model_path=model_path, store=store,
                               log_dir=log_dir, console=console, server=server)
    with status(console, "starting the inference server"):
        try:
            collector.start()
        except ServerError as e:
            collector.stop()
            raise RunError(f"the inference server did not start: {e}") from None
    try:
        yield Session(cfg, console, collector, store, credit_rule)
        say_replicas(console, gateway)
    except BaseException:
        # Ending on an error or a Ctrl-C: a teardown that fails too (spans that do not drain in time on a loaded
        # machine) is said, never raised in its place, so the run ends with what stopped it (exit 130 for Ctrl-C).
        try:
            close(collector, gateway)
        except Exception as e:  # noqa: BLE001 - reported; the error in flight is raised
            console.print(f"[yellow]while stopping: {escape(first_line(f'{type(e).__name__}: {e}'))}",
                          highlight=False, soft_wrap=True)
        raise
    close(collector, gateway)


def say_replicas(console: Console, gateway: Gateway | IsolatedGateway) -> None:
    """With several inference servers, how many calls each served (and those left out of the rotation)."""
    b = gateway.backends
    if b is not None and len(b.urls) > 1:
        out = f"; {len(b.out)} refused connections and were left out of the rotation" if b.out else ""
        console.print(f"{len(b.urls)} inference servers served {' / '.join(map(str, b.served))} calls{out}",
                      highlight=False, soft_wrap=True, markup=False)


def close(collector: Collector, gateway: Gateway | IsolatedGateway) -> None:
    """The collector stopped, and every call record and span it made written to the store."""
    try:
        collector.stop()
    finally:
        gateway.capture.flush()
        gateway.capture.record_to(None)
        tracing.flush()


@contextmanager
def store_session(cfg: Config, console: Console, tasks: list[dict], db: Path, log_dir: Path, credit_rule: Any,
                  *, run_dir: Path, resume: bool, server: InferenceServer | None = None) -> Iterator[Session]:
    """The run's gateway, agent and inference server over the store `db`, which gets `tasks`; `server`: a running
    one to borrow (servers.lent) instead of starting one."""
    with ExitStack() as stack:
        gateway = bind_gateway(cfg, stack, run_dir, resume=resume)
        agent = agent_of(cfg)
        model_path = models.resolve(cfg.model.name)
        store = stack.enter_context(Store(db))
        store.add_tasks((data.task_id(t), t) for t in tasks)
        with open_session(cfg, console, agent, gateway, model_path, store, log_dir, credit_rule,
                          server=server) as session:
            yield session
