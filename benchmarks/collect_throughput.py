"""Throughput of the collection phase at 1, 4 and 16 concurrent rollouts on the built-in CPU server.

    python benchmarks/collect_throughput.py --rollouts 96

The default agent (cookbook/arith/agent.py: one async OpenAI chat call per rollout, max_tokens 8) runs the way
`lightning run` runs it: run_rollout inside a rollout context, spans traced into a SQLite store, rewards scored,
at most `concurrency` rollouts at once, its calls through the run's gateway (gateway/proxy.py), the startup heap
frozen (lightning_sdk/heap.py). One server for all settings; each setting runs once to warm up, then is timed
`--repeats` times (best kept). Generated tokens come from the server's own counter. At the highest concurrency the
same jobs also go straight to the server, to show what the gateway's hop costs: the two ways alternate, pass by
pass (which goes first alternates too), and the ratio is the median of the pairs', so a load that changes during
the run weighs on both sides alike.

Prints rollouts/s and generated tokens/s per concurrency, `gateway_ratio=<through the gateway / straight to the
server, median of the alternating pairs>` and `ratio=<rollouts/s at 16 / at 1>` last.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from lightning_sdk import data, tracing
from lightning_sdk.agent import LLM
from lightning_sdk.agent import load_agent
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.heap import frozen_heap
from lightning_sdk.store import Store
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.job import RolloutJob

ROOT = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser()
p.add_argument("--rollouts", type=int, default=96)
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
args = p.parse_args()

rollout_fn, reward_fn = load_agent(str(ROOT / "cookbook/arith/agent.py"), None, None)
tasks = data.load(ROOT / "cookbook/arith/data/train.jsonl")
tmp = Path(tempfile.mkdtemp(prefix="ls-collect-bench-"))
store = Store(tmp / "store.sqlite")


async def collect(llm: LLM, concurrency: int, n: int) -> int:
    gate = asyncio.Semaphore(concurrency)
    jobs = [RolloutJob(f"b-{uuid.uuid4().hex[:10]}", data.task_id(t), f"g{i // 8}", t, 0)
            for i, t in enumerate((tasks * (n // len(tasks) + 1))[:n])]

    async def one(job: RolloutJob):
        async with gate:
            gateway.rollouts.open(job.trace_id, job.rollout_id)  # as a runtime does
            try:
                return await run_rollout(job, rollout_fn=rollout_fn, reward_fn=reward_fn, llm=llm, store=store,
                                         timeout=60)
            finally:
                gateway.rollouts.close(job.trace_id)

    results = await asyncio.gather(*(one(j) for j in jobs))
    return sum(r.status == "succeeded" for r in results)


def one_pass(llm: LLM, c: int, stats) -> tuple[float, float, dict]:
    """Rollouts/s and generated tokens/s of one pass of args.rollouts at concurrency c, and the server's counts."""
    s0, t0 = stats(), time.perf_counter()
    ok = asyncio.run(collect(llm, c, args.rollouts))
    dt, s1 = time.perf_counter() - t0, stats()
    if ok != args.rollouts:
        raise SystemExit(f"{args.rollouts - ok} rollouts failed; see {tmp / 'server.log'}")
    counts = {k: s1[k] - s0[k] for k in ("requests", "batches", "prefills", "joined")}
    return ok / dt, (s1["generated_tokens"] - s0["generated_tokens"]) / dt, counts


def timed(llm: LLM, c: int, stats) -> tuple[float, float, dict]:
    one_pass(llm, c, stats)  # warms up
    best = max((one_pass(llm, c, stats) for _ in range(args.repeats)), key=lambda r: r[0])
    return best


def paired(via: LLM, direct: LLM, c: int, stats) -> tuple[list[float], list[float]]:
    """Rollouts/s through the gateway and straight to the server, the two alternating (each pair's order too)."""
    one_pass(via, c, stats), one_pass(direct, c, stats)  # warm up both
    ours, theirs = [], []
    for rep in range(args.repeats):
        first, second = (via, direct) if rep % 2 == 0 else (direct, via)
        a, b = one_pass(first, c, stats)[0], one_pass(second, c, stats)[0]
        ours.append(a if first is via else b)
        theirs.append(b if first is via else a)
    return ours, theirs


with CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, log_path=tmp / "server.log") as server:
    gateway = Gateway(api_key="bench")
    gateway.start([server.url], backend_key=server.api_key)
    gateway.policy = "policy"
    tracing.install(store, gateway_url=gateway.base_url)
    gateway.capture.record_to(store)  # every call through the gateway is recorded, as in a run
    llm = LLM(base_url=gateway.base_url, api_key="bench", model="gpt-4o-mini")  # as an unchanged agent names it
    stats = lambda: httpx.get(f"{server.url}/stats").json()  # noqa: E731
    with frozen_heap():  # as `lightning run` collects (lightning_sdk/heap.py)
        rate: dict[int, tuple[float, float]] = {}
        for c in args.concurrency:
            *rate[c], d = timed(llm, c, stats)
            print(f"concurrency {c:>3}: {rate[c][0]:6.1f} rollouts/s  {rate[c][1]:7.1f} generated tokens/s "
                  f"(best of {args.repeats}, {args.rollouts} rollouts; last pass: {d['requests']} requests in "
                  f"{d['batches']} batches, {d['prefills']} prefills, {d['joined']} joined a running batch)")
        hi = max(args.concurrency)
        ours, theirs = paired(llm, LLM(base_url=server.base_url, api_key="EMPTY", model="policy"), hi, stats)
        print(f"concurrency {hi:>3}, alternating: through the gateway {' '.join(f'{r:.1f}' for r in ours)}, straight "
              f"to the server {' '.join(f'{r:.1f}' for r in theirs)} rollouts/s")
    gateway.stop()
tracing.flush()
store.close()
lo = min(args.concurrency)
pairs = [a / b for a, b in zip(ours, theirs)]
print(f"gateway_ratio={statistics.median(pairs):.2f}  (rollouts/s through the gateway / straight to the server at "
      f"{hi}, median of {len(pairs)} alternating pairs: {' '.join(f'{r:.2f}' for r in pairs)})")
print(f"ratio={rate[hi][0] / rate[lo][0]:.2f}  (rollouts/s at concurrency {hi} / at {lo})")
