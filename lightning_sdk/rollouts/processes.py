"""The processes runtime (`run.runtime = "processes"`): rollouts in local worker processes, one rollout at a time
each, so an agent that is not safe to run in threads (per-run state kept on an object built at import, as
smolagents' agents do) keeps the run's concurrency.

It is the remote runtime with its workers started here: rollout.concurrency `lightning worker` processes, each
with --concurrency 1, reading the run's server.json and worker.token from the run directory; their output goes to
workers.log there. They stop with the run (told it is over, then SIGTERM, then SIGKILL), and end by themselves when
the run's process is gone (killed with -9 included). A worker that ends while the run goes on is said and replaced.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from lightning_sdk.config import Config
from lightning_sdk.errors import RunError
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.rollouts.collector import Agent
from lightning_sdk.rollouts.remote.collect import RemoteCollector
from lightning_sdk.rollouts.remote.worker import LIFELINE_ENV
from lightning_sdk.servers import InferenceServer
from lightning_sdk.store import Store
from lightning_sdk.tracing.export import ENDPOINT_ENV

WORKERS_LOG = "workers.log"
STOP_S = 10.0  # how long a worker gets to stop on SIGTERM before it is killed
MAX_REPLACEMENTS = 3  # per worker the run starts: workers that end are replaced up to this many times each


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class ProcessesCollector(RemoteCollector):
    # This process imports the agent too (a module that fails to import is one line before anything starts).
    runs_agent = True

    def __init__(self, cfg: Config, *, agent: Agent | None, gateway: Gateway, model_path: str, store: Store,
                 log_dir: Path, console: Console, server: InferenceServer | None = None):
        super().__init__(cfg, agent=agent, gateway=gateway, model_path=model_path, store=store, log_dir=log_dir,
                         console=console, server=server)
        self.procs: list[subprocess.Popen] = []
        self.log_path = Path(log_dir) / WORKERS_LOG
        self._lifeline_r: int | None = None
        self._lifeline_w: int | None = None
        self._replaced = 0

    def announce(self) -> None:
        n = self.cfg.rollout.concurrency
        # The workers hold the pipe's read end, this process alone its write end: when this process ends, however
        # it ends, they read end of file and exit (worker.end_with_run).
        self._lifeline_r, self._lifeline_w = os.pipe()
        self.procs = [self._start_worker() for _ in range(n)]
        self.console.print(f"rollouts in {n} worker processes (run.runtime = 'processes'), one rollout at a time "
                           f"each; their log: {self.log_path}", highlight=False, soft_wrap=True, markup=False)

    def _start_worker(self) -> subprocess.Popen:
        a = self.cfg.agent
        command = [sys.executable, "-m", "lightning_sdk.cli", "worker", a.module, "--run-dir", str(self.run_dir),
                   "--concurrency", "1"]
        command += ["--rollout", a.rollout] if a.rollout else []
        command += ["--reward", a.reward] if a.reward else []
        # this process's import path (an agent module found through it, an editable checkout) goes to the workers;
        # the collector the environment names does not: the run exports the workers' spans there, roots included
        env = {**{k: v for k, v in os.environ.items() if k not in ENDPOINT_ENV},
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), LIFELINE_ENV: str(self._lifeline_r)}
        with self.log_path.open("ab") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    pass_fds=(self._lifeline_r,),
                                    cwd=Path(a.module).parent if a.module.endswith(".py") else None)

    def stop(self) -> None:
        try:
            super().stop()  # tells the workers the run is over; they exit
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.terminate()
            for p in self.procs:
                try:
                    p.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for fd in (self._lifeline_r, self._lifeline_w):
                if fd is not None:
                    os.close(fd)
            self._lifeline_r = self._lifeline_w = None

    def _replace_ended(self) -> None:
        """A worker killed by a signal while the run goes on (the OOM killer, a crash, kill -9) is said, and another
        started in its place, at most MAX_REPLACEMENTS times per worker the run started. One that exited by itself
        (an agent that cannot load exits 2) is not replaced: starting it again would fail the same way, so the run
        fails below, once all have ended, with the end of workers.log."""
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is None or code >= 0 or self._replaced >= MAX_REPLACEMENTS * len(self.procs):
                continue
            self._replaced += 1
            self.procs[i] = self._start_worker()
            self.console.print(f"rollout worker {p.pid} ended (killed by {_signal_name(-code)}); started worker "
                               f"{self.procs[i].pid} in its "
                               f"place (replacement {self._replaced} of at most "
                               f"{MAX_REPLACEMENTS * len(self.procs)}); a rollout it held is re-run after its deadline",
                               highlight=False, soft_wrap=True, markup=False)

    def _check_workers(self, waiting_since: float, left: int) -> None:
        self._replace_ended()
        if self.procs and all(p.poll() is not None for p in self.procs):
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:] if self.log_path.exists() else []
            raise RunError(f"all {len(self.procs)} rollout worker processes exited (run.runtime = 'processes') with "
                           f"{left} rollout(s) left; the end of {self.log_path}: " + " | ".join(tail))
        super()._check_workers(waiting_since, left)
