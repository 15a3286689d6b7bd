"""Throughput of the collection phase at 1, 4 and 16 concurrent rollouts on the built-in CPU server.

    python benchmarks/collect_throughput.py --rollouts 96

The default agent (cookbook/arith/agent.py: one async OpenAI chat call per rollout, max_tokens 8) runs the way
`lightning run` runs it: run_rollout inside a rollout context, spans traced into a SQLite store, rewards scored,
at most `concurrency` rollouts at once, its calls through the run's gateway served from a process of its own
(gateway/isolated.py, as the in-process runtime serves it; each rollout opened there before its agent runs), the
startup heap frozen (lightning_sdk/heap.py). One server for all settings; each setting runs once to warm up, then is
timed `--repeats` times (best kept). Generated tokens come from the server's own counter. At the highest
concurrency the same jobs also go straight to the server, and through the gateway served from a thread of this
process (gateway/proxy.py, as before), to show what the hop costs each way: the three alternate, pass by pass
(their order rotates too), so a load that changes during the run weighs on all alike.

Prints rollouts/s and generated tokens/s per concurrency, `gateway_ratio=<through the gateway / straight to the
server, median of the alternating rounds>` (with the ratio of the mean rates, `pooled`), the same for the gateway in
a thread (`thread_ratio`), and `ratio=<rollouts/s at 16 / at 1>` last.
"""

import argparse
import asyncio
import collections
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
from lightning_sdk.gateway.isolated import IsolatedGateway
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.heap import frozen_heap
from lightning_sdk.store import Store
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.job import RolloutJob

from interval import bootstrap

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
cpu_ms: dict[int, list[float]] = collections.defaultdict(list)  # this process's CPU per rollout, by way, per pass


class Way:
    """Where a pass's agents send their calls: `gateway`'s per-rollout URL (as the in-process runtime gives them),
    or straight to the server at `direct`; the rollouts are opened at `gateway` either way."""

    def __init__(self, gateway, direct: str | None = None):
        self.gateway, self.direct = gateway, direct

    def llm(self, job: RolloutJob) -> LLM:
        if self.direct is not None:
            return LLM(base_url=self.direct, api_key="EMPTY", model="policy")
        return LLM(base_url=self.gateway.rollout_base_url(job.trace_id), api_key="bench", model="gpt-4o-mini")


async def collect(way: Way, concurrency: int, n: int) -> int:
    gate = asyncio.Semaphore(concurrency)
    jobs = [RolloutJob(f"b-{uuid.uuid4().hex[:10]}", data.task_id(t), f"g{i // 8}", t, 0)
            for i, t in enumerate((tasks * (n // len(tasks) + 1))[:n])]

    async def one(job: RolloutJob):
        async with gate:
            way.gateway.rollouts.open(job.trace_id, job.rollout_id)  # as the in-process runtime does
            try:
                return await run_rollout(job, rollout_fn=rollout_fn, reward_fn=reward_fn, llm=way.llm(job),
                                         store=store, timeout=60)
            finally:
                way.gateway.rollouts.close(job.trace_id)

    results = await asyncio.gather(*(one(j) for j in jobs))
    return sum(r.status == "succeeded" for r in results)


def one_pass(way: Way, c: int, stats) -> tuple[float, float, dict]:
    """Rollouts/s and generated tokens/s of one pass of args.rollouts at concurrency c, and the server's counts."""
    tracing.install(store, gateway_url=way.gateway.base_url)  # rollout context toward this pass's gateway
    s0, t0, c0 = stats(), time.perf_counter(), time.process_time()
    ok = asyncio.run(collect(way, c, args.rollouts))
    dt, s1 = time.perf_counter() - t0, stats()
    cpu_ms[id(way)].append((time.process_time() - c0) / args.rollouts * 1e3)
    if ok != args.rollouts:
        raise SystemExit(f"{args.rollouts - ok} rollouts failed; see {tmp / 'server.log'}")
    counts = {k: s1[k] - s0[k] for k in ("requests", "batches", "prefills", "joined")}
    return ok / dt, (s1["generated_tokens"] - s0["generated_tokens"]) / dt, counts


def timed(way: Way, c: int, stats) -> tuple[float, float, dict]:
    one_pass(way, c, stats)  # warms up
    best = max((one_pass(way, c, stats) for _ in range(args.repeats)), key=lambda r: r[0])
    return best


def rounds(ways: dict[str, Way], c: int, stats) -> dict[str, list[float]]:
    """Rollouts/s each way, `args.repeats` rounds of one pass each, the order rotating round by round."""
    for way in ways.values():
        one_pass(way, c, stats)  # warm up each
    names, out = list(ways), {name: [] for name in ways}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            out[name].append(one_pass(ways[name], c, stats)[0])
    return out


def say_ratio(label: str, ours: list[float], theirs: list[float]) -> None:
    pairs = [a / b for a, b in zip(ours, theirs)]
    pooled = lambda a, b: statistics.mean(a) / statistics.mean(b)  # noqa: E731
    lo, hi_ = bootstrap(pooled, ours, theirs, paired=True)
    print(f"{label}={statistics.median(pairs):.2f}  pooled={pooled(ours, theirs):.3f} [{lo:.3f}, {hi_:.3f}]  "
          f"(rollouts/s at {hi} / straight to the server, median of {len(pairs)} rounds: "
          f"{' '.join(f'{r:.2f}' for r in pairs)}; in brackets the pooled ratio's 95% interval over the rounds)")


with CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, log_path=tmp / "server.log") as server:
    gateways = {"apart": IsolatedGateway(api_key="bench"), "thread": Gateway(api_key="bench")}
    for g in gateways.values():
        g.start([server.url], backend_key=server.api_key, grammar=server.grammar)
        g.policy = "policy"
        g.capture.record_to(store)  # every call through a gateway is recorded, as in a run
    via = {name: Way(g) for name, g in gateways.items()}
    stats = lambda: httpx.get(f"{server.url}/stats").json()  # noqa: E731
    with frozen_heap():  # as `lightning run` collects (lightning_sdk/heap.py)
        rate: dict[int, tuple[float, float]] = {}
        for c in args.concurrency:
            *rate[c], d = timed(via["apart"], c, stats)
            print(f"concurrency {c:>3}: {rate[c][0]:6.1f} rollouts/s  {rate[c][1]:7.1f} generated tokens/s "
                  f"(best of {args.repeats}, {args.rollouts} rollouts; last pass: {d['requests']} requests in "
                  f"{d['batches']} batches, {d['prefills']} prefills, {d['joined']} joined a running batch)")
        hi = max(args.concurrency)
        # Straight to the server, the rollouts opened in this process as before (no gateway is called)
        direct = Way(gateways["thread"], direct=server.base_url)
        cpu_ms.clear()  # the rounds only; each way's first pass warms up
        out = rounds({**via, "direct": direct}, hi, stats)
        print(f"concurrency {hi:>3}, rotating: " + "; ".join(
            f"{name} {' '.join(f'{r:.1f}' for r in rs)}" for name, rs in out.items()) + " rollouts/s")
        ways = {**via, "direct": direct}
        print(f"concurrency {hi:>3}, this process's CPU per rollout (mean of the timed passes): " + ", ".join(
            f"{name} {statistics.mean(cpu_ms[id(w)][1:]):.2f} ms" for name, w in ways.items()))
    for g in gateways.values():
        g.capture.record_to(None)
        g.stop()
tracing.flush()
store.close()
lo = min(args.concurrency)
say_ratio("gateway_ratio", out["apart"], out["direct"])
say_ratio("thread_ratio", out["thread"], out["direct"])
print(f"ratio={rate[hi][0] / rate[lo][0]:.2f}  (rollouts/s at concurrency {hi} / at {lo})")
