"""Rollouts/s of the Ray runtime's collection phase at 1 vs 2 local rollout workers (same server, same jobs).

    python benchmarks/ray_scaling.py --rollouts 128

Prints rollouts/s for each worker count and the ratio 2 workers / 1 worker, measured in the same run.
"""

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import ray
from rich.console import Console

from lightning_sdk import config, data, models
from lightning_sdk.agent import load_agent
from lightning_sdk.rollouts.collector import Agent
from lightning_sdk.rollouts.ray import RayCollector
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.process import new_api_key
from lightning_sdk.store import Store
from lightning_sdk.rollouts.job import RolloutJob

ROOT = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser()
p.add_argument("--rollouts", type=int, default=128)
p.add_argument("--repeats", type=int, default=2)
args = p.parse_args()
ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
tasks = data.load(ROOT / "cookbook/arith/data/train.jsonl")
rate = {}
for workers in (1, 2):
    cfg = config.load(ROOT / "lightning.toml")
    cfg.ray.num_workers = workers
    tmp = Path(tempfile.mkdtemp(prefix="ls-ray-bench-"))
    store = Store(tmp / "store.sqlite")
    agent = Agent(cfg.agent.module, *load_agent(cfg.agent.module, cfg.agent.rollout, cfg.agent.reward))
    gateway = Gateway(api_key=new_api_key())
    cluster = RayCollector(cfg, agent=agent, gateway=gateway, model_path=models.resolve(cfg.model.name),
                           store=store, log_dir=tmp, console=Console(quiet=True))
    cluster.start()
    gateway.policy = cfg.model.name
    best = 0.0
    for rep in range(args.repeats + 1):  # the first pass warms the workers and the server
        jobs = [RolloutJob(f"b{rep}-{i}-{uuid.uuid4().hex[:6]}", data.task_id(t), f"{i}", t, 0)
                for i, t in enumerate((tasks * 10)[: args.rollouts])]
        t0 = time.perf_counter()
        res = cluster.collect(jobs, cfg.model.name, label="bench")
        dt = time.perf_counter() - t0
        assert all(r.status == "succeeded" for r in res)
        if rep:
            best = max(best, len(jobs) / dt)
    cluster.stop()
    gateway.stop()
    rate[workers] = best
    print(f"{workers} worker(s): {best:.1f} rollouts/s (best of {args.repeats}, {args.rollouts} rollouts)")
print(f"ratio 2 workers / 1 worker: {rate[2] / rate[1]:.2f}x")
