"""Rollouts/s of a collection phase: the embedded runtime vs the remote runtime with 2 `lightning worker`s.

    python benchmarks/remote_throughput.py --rollouts 128 --repeats 2

Both sides are the real collectors (rollouts/embedded.py, rollouts/remote/collect.py) with the default config
(lightning.toml: the builtin tiny model on the built-in CPU server, behind the gateway) and the default agent
(cookbook/arith/agent.py), on the same jobs: embedded runs `rollout.concurrency` = 16 rollouts at once in this
process; remote serves 2 worker processes on this machine with `--concurrency 8` each, whose spans come back over
OTLP/HTTP and results over the work API. Each side runs the jobs once to warm up, then `--repeats` times (best
kept). Prints rollouts/s per side and `ratio=<remote / embedded>` last.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rich.console import Console

from lightning_sdk import config, data, models, tracing
from lightning_sdk.agent import load_agent
from lightning_sdk.rollouts.collector import Agent
from lightning_sdk.rollouts.embedded import EmbeddedCollector
from lightning_sdk.rollouts.remote.collect import RemoteCollector
from lightning_sdk.rollouts.job import RolloutJob
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.process import new_api_key
from lightning_sdk.store import Store

ROOT = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser()
p.add_argument("--rollouts", type=int, default=128)
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--workers", type=int, default=2)
args = p.parse_args()

cfg = config.override(config.load(ROOT / "lightning.toml"), {"rollout.concurrency": 16})
model_path = models.resolve(cfg.model.name)
tasks = data.load(cfg.data.train)
module = str(ROOT / "cookbook/arith/agent.py")


def jobs(tag: str) -> list[RolloutJob]:
    return [RolloutJob(f"{tag}-{i}-{uuid.uuid4().hex[:6]}", data.task_id(t), f"{tag}:{i // 8}", t, 1)
            for i, t in enumerate((tasks * (args.rollouts // len(tasks) + 1))[: args.rollouts])]


def measure(runtime: str) -> float:
    tmp = Path(tempfile.mkdtemp(prefix=f"ls-{runtime}-bench-"))
    store = Store(tmp / "store.sqlite")
    gateway = Gateway(api_key=new_api_key())
    agent = Agent(module, *load_agent(module, None, None)) if runtime == "embedded" else None
    cls = EmbeddedCollector if runtime == "embedded" else RemoteCollector
    collector = cls(cfg, agent=agent, gateway=gateway, model_path=model_path, store=store, log_dir=tmp,
                    console=Console(quiet=True))
    collector.start()
    gateway.policy = collector.server.served_model_name
    tracing.install(store, gateway_url=gateway.base_url)
    gateway.capture.record_to(store)  # as a run's session does
    workers = []
    if runtime == "remote":
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        workers = [subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "worker", module, "--run-dir",
                                     str(tmp), "--concurrency", str(16 // args.workers)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for _ in range(args.workers)]
    best = 0.0
    try:
        for rep in range(args.repeats + 1):  # the first pass warms up (and, remote, waits for the workers)
            batch = jobs(f"{runtime}{rep}")
            t0 = time.perf_counter()
            results = collector.collect(batch, gateway.policy, label="bench")
            dt = time.perf_counter() - t0
            failed = [r.error for r in results if r.status != "succeeded"]
            if failed:
                raise SystemExit(f"{runtime}: {len(failed)} rollouts failed, first: {failed[0]}")
            if rep:
                best = max(best, len(batch) / dt)
    finally:
        collector.stop()
        gateway.stop()
        for w in workers:
            w.wait(timeout=60)
        tracing.flush()
        store.close()
    return best


rate = {}
for runtime in ("embedded", "remote"):
    rate[runtime] = measure(runtime)
    how = ("16 at once in this process" if runtime == "embedded" else
           f"{args.workers} lightning worker processes x {16 // args.workers} at once")
    print(f"{runtime:>8}: {rate[runtime]:6.1f} rollouts/s  ({how}; best of {args.repeats}, {args.rollouts} rollouts)")
print(f"ratio={rate['remote'] / rate['embedded']:.2f}  (remote with {args.workers} workers / embedded)")
