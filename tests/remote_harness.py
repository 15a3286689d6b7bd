"""A Lightning server's API without a trainer, for the remote-runtime tests: a real gateway on 127.0.0.1 in front
of the real CPU server, with the work and OTLP routes on a real store; `restart` stops it and serves it again on
the same port (what a worker sees when the server restarts)."""

from __future__ import annotations

import time

from lightning_sdk.rollouts.remote.dispatch import Dispatch
from lightning_sdk.rollouts.remote.routes import work_router
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.store import Store

KEY = "worker-token"  # the workers' key: the work routes only
AGENTS_KEY = "agents-key"  # the agents' key: the LLM routes only


class Api:
    def __init__(self, server, store: Store, *, timeout: float = 60.0, max_body_bytes: int = 256 * 1024):
        self.server, self.store, self.timeout, self.max_body_bytes = server, store, timeout, max_body_bytes
        self.dispatch = Dispatch(store)
        self.gateway = self._serve(port=0)
        self.url = self.gateway.url

    def _serve(self, port: int) -> Gateway:
        g = Gateway(api_key=AGENTS_KEY, port=port, rollouts=self.dispatch.rollouts)
        g.add_routes(work_router(self.dispatch, run_name="test", api_key=AGENTS_KEY, redirect_openai=True,
                                 max_body_bytes=self.max_body_bytes), api_key=KEY)
        g.capture.record_to(self.store)  # the calls' records, as a run's gateway writes them
        g.policy = self.server.served_model_name  # before it listens: a worker's first call may come at once
        g.start([self.server.url], backend_key=self.server.api_key, grammar=self.server.grammar)
        return g

    def restart(self, down_s: float) -> None:
        port = int(self.url.rsplit(":", 1)[1])
        self.gateway.stop()
        time.sleep(down_s)
        self.gateway = self._serve(port)

    def stop(self) -> None:
        self.gateway.capture.flush()
        self.gateway.stop()

    def queue(self, jobs: list[RolloutJob], *, deadline_s: float = 60.0) -> None:
        self.dispatch.open(list(enumerate(jobs)), policy=self.server.served_model_name, label="test",
                           timeout=self.timeout, deadline_s=deadline_s)

    def results(self, n: int, timeout: float = 60.0) -> list[RolloutResult]:
        """The next `n` results, in the order they came (bounded wait)."""
        out, until = [], time.monotonic() + timeout
        while len(out) < n and time.monotonic() < until:
            out += [f.result for f in self.dispatch.wait(0.2)]
        assert len(out) == n, f"{len(out)} of {n} results within {timeout}s"
        assert self.gateway.capture.flush()
        return out


def job(k: int, task: dict, *, prefix: str = "r") -> RolloutJob:
    return RolloutJob(rollout_id=f"{prefix}-{k}", task_id=f"t{k}", group_id=f"g{k // 2}", task=task, iteration=1)


def start_remote_run(d, env: dict, *, timeout: float = 180.0):
    """`lightning run` in folder `d` (its lightning.toml: run.runtime = "remote", run.dir = "run"), waited for until
    its server is up: (the process, the server's URL)."""
    import json
    import subprocess
    import sys

    trainer = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run"], cwd=d, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + timeout
    while not (d / "run/server.json").exists():
        if trainer.poll() is not None or time.monotonic() > end:
            trainer.kill()
            raise AssertionError(trainer.stdout.read())
        time.sleep(0.1)
    return trainer, json.loads((d / "run/server.json").read_text())["url"]
