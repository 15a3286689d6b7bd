"""The remote runtime (`run.runtime = "remote"`), the Lightning Server: `lightning worker` processes (the Lightning
Client, lightning_sdk/rollouts/remote/worker.py) run the agent in its own folder and environment, here or on other machines.

This process serves the policy as the embedded runtime does (the same inference server, restarts included: this
class extends `EmbeddedCollector`) and adds the work routes and `POST /v1/traces` to the run's gateway, so
workers need one URL and one token (the workers' own key, written to `run_dir/worker.token`, mode 0600, with the
URL in `run_dir/server.json`; the agents' key, handed to workers, opens the LLM routes only). It never imports the agent module.

A phase's jobs wait in `Dispatch` until workers claim them. A claim holds until rollout.timeout + remote.grace;
past that the rollout is marked abandoned (its spans kept) and re-run once under a new id, and whatever the
first worker sends later is refused. A result that failed because the inference server died under it re-runs
once too, after the server is restarted. When rollouts wait and no worker has been heard from for
remote.worker_timeout seconds, the run stops and says how to start one. Protocol and setup: docs/remote.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from lightning_sdk.config import Config
from lightning_sdk.errors import RunError
from lightning_sdk.files import atomic_write_text
from lightning_sdk.rollouts.collector import Agent, progress_bar
from lightning_sdk.rollouts.remote.dispatch import Claimed, Dispatch
from lightning_sdk.rollouts.embedded import EmbeddedCollector
from lightning_sdk.rollouts.remote.protocol import SERVER_FILE, TOKEN_FILE
from lightning_sdk.rollouts.remote.routes import work_router
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers import InferenceServer
from lightning_sdk.servers.process import new_api_key
from lightning_sdk.store import Store

GOODBYE_S = 3.0  # at the end, how long workers heard from lately get to learn that the run is over
_POLL_S = 0.5  # how often collect looks at deadlines and worker contact while it waits for results


class RemoteCollector(EmbeddedCollector):
    runs_agent = False  # workers import the agent, in their own environment; this process never does
    gateway_apart = False  # its routes (work, OTLP) are served on the gateway's address, from this process

    def __init__(self, cfg: Config, *, agent: Agent | None, gateway: Gateway, model_path: str, store: Store,
                 log_dir: Path, console: Console, server: InferenceServer | None = None):
        super().__init__(cfg, agent=agent, gateway=gateway, model_path=model_path, store=store, log_dir=log_dir,
                         console=console, server=server)
        self.run_dir = Path(log_dir)
        self.dispatch = Dispatch(store, rollouts=gateway.rollouts)
        # The workers' key: opens the work routes only. A resumed run keeps the one its killed run left, so that
        # workers still running (retrying meanwhile) go on working with it.
        self.worker_token = _previous_token(self.token_file) or new_api_key()
        self._refused_shown = 0

    @property
    def token_file(self) -> Path:
        return self.run_dir / TOKEN_FILE

    def start(self) -> None:
        cfg = self.cfg
        self.gateway.add_routes(work_router(
            self.dispatch, run_name=cfg.run.name, api_key=self.gateway.api_key,
            redirect_openai=cfg.agent is None or cfg.agent.redirect_openai), api_key=self.worker_token)
        super().start()  # the inference server, then the gateway in front of it, with our routes
        self._write_access()
        self.announce()

    def announce(self) -> None:
        """Say where workers connect and how to start one."""
        cfg, url = self.cfg, self.gateway.url
        self.console.print(
            f"Lightning server for run {cfg.run.name!r} at {url}: waiting for workers. In the agent's folder and "
            f"environment, start one with\n  lightning worker --server {url} --token-file {self.token_file}\n"
            f"(on this machine: lightning worker --run-dir {self.run_dir}). The token is in {self.token_file} "
            f"(readable by this user only); it is never printed, so it stays out of logs"
            + ("" if cfg.serve.host not in ("127.0.0.1", "::1", "localhost") else
               "\nIt listens on this machine only: set serve.host (e.g. 0.0.0.0) for workers on others."),
            highlight=False, soft_wrap=True, markup=False)

    def stop(self) -> None:
        self.dispatch.end()
        try:
            self._goodbye()
        finally:
            for name in (TOKEN_FILE, SERVER_FILE):  # the URL and key die with this server
                (self.run_dir / name).unlink(missing_ok=True)
            super().stop()

    def _write_access(self) -> None:
        """worker.token (the workers' key: readable by this user only) and server.json ({"url": ...})."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
            os.write(fd, f"{self.worker_token}\n".encode())
        finally:
            os.close(fd)
        atomic_write_text(self.run_dir / SERVER_FILE, json.dumps({"url": self.gateway.url}))

    def _goodbye(self) -> None:
        """Give workers heard from lately a moment to claim once more and hear that the run is over (410)."""
        until = time.monotonic() + GOODBYE_S
        while time.monotonic() < until:
            if not self.dispatch.untold():
                return
            time.sleep(0.05)

    # ------------------------------------------------------------------------------------------ a phase

    def collect(self, jobs: list[RolloutJob], policy: str, *, label: str) -> list[RolloutResult]:
        cfg, d = self.cfg, self.dispatch
        results: dict[int, RolloutResult] = {}
        d.generation = self._generation
        d.open(list(enumerate(jobs)), policy=policy, label=label, timeout=cfg.rollout.timeout,
               deadline_s=cfg.rollout.timeout + cfg.remote.grace)
        waiting_since = time.monotonic()
        try:
            with progress_bar(self.console, label, len(jobs)) as advance:
                while len(results) < len(jobs):
                    for f in d.wait(_POLL_S):
                        retry = self._rerun_after_server_loss(f.claim, f.result)
                        if retry is None:
                            results[f.claim.index] = f.result
                            advance()
                    for claim in d.expire():
                        failed = self._abandon(claim)
                        if failed is not None:
                            results[claim.index] = failed
                            advance()
                    self._check_workers(waiting_since, len(jobs) - len(results))
        finally:
            d.close_phase()
            self._report_refused()
        return [results[i] for i in range(len(jobs))]

    def _abandon(self, claim: Claimed) -> RolloutResult | None:
        """A claim past its deadline: abandoned (spans kept) and re-run once; the failed result after that."""
        job = claim.job
        why = (f"no result from worker {claim.worker} within {self.dispatch.deadline_s:g}s (rollout.timeout + "
               f"remote.grace)")
        if job.attempt == 1:
            retry = job.retry()
            self.store.abandon(job.rollout_id, f"{why}; re-run as {retry.rollout_id}")
            self.console.print(f"[yellow]{escape(job.rollout_id)}: {escape(why)}; re-running it as "
                               f"{escape(retry.rollout_id)}", highlight=False)
            self.dispatch.requeue(claim.index, retry)
            return None
        self.store.abandon(job.rollout_id, why)
        return RolloutResult(job, "failed", None, None, f"WorkerLost: {why} (attempt {job.attempt})")

    def _rerun_after_server_loss(self, claim: Claimed, result: RolloutResult) -> RolloutJob | None:
        """A failed first attempt whose inference server died under it (as the embedded runtime): the server is
        restarted (once for all) and the rollout re-run; None when the result stands."""
        if result.status != "failed" or claim.job.attempt > 1:
            return None
        if self._generation == claim.generation and self._server_up():
            return None
        if self._generation == claim.generation:
            self._restart()
            self.dispatch.generation = self._generation
        retry = claim.job.retry()
        self.store.abandon(claim.job.rollout_id, f"the inference server died during the rollout; re-run as "
                                                 f"{retry.rollout_id} ({result.error})")
        self.dispatch.requeue(claim.index, retry)
        return retry

    def _check_workers(self, waiting_since: float, left: int) -> None:
        d = self.dispatch
        queued, claimed = d.counts()
        if not queued or claimed:
            return
        idle = time.monotonic() - max(d.last_contact, waiting_since)
        if idle > self.cfg.remote.worker_timeout:
            raise RunError(
                f"{left} rollout(s) waited {idle:.0f}s and no worker contacted the server (remote.worker_timeout = "
                f"{self.cfg.remote.worker_timeout:g}s). Start one in the agent's folder: lightning worker --server "
                f"{self.gateway.url} --token-file {self.token_file}  (on this machine: lightning worker --run-dir "
                f"{self.run_dir})")

    def _report_refused(self) -> None:
        refused = self.dispatch.spans_refused
        total = sum(refused.values())
        if total > self._refused_shown:
            self._refused_shown = total
            reasons = "; ".join(f"{n} {why}" for why, n in sorted(refused.items()))
            self.console.print(f"[yellow]{total} span(s) from workers refused so far: {escape(reasons)}",
                               highlight=False, soft_wrap=True)


def _previous_token(path: Path) -> str | None:
    """The workers' key a killed run left in its directory (a clean stop removes it), if it looks like one."""
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token if len(token) >= 32 and token.isascii() and token.isprintable() else None
