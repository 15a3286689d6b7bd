"""What tracing costs an agent: OpenAI-client calls to the built-in server on loopback, traced vs untraced.

    python benchmarks/tracing_overhead.py --calls 400

One process, one server, one client. Each pair of calls makes one plain call and one traced call (inside a
rollout context, through opentelemetry-instrumentation-openai, our token-id wrapper, the span processor and the
SQLite store writer), in alternating order so drift on the shared machine cancels out. Both send the same request
body (logprobs and `return_token_ids`, which tracing asks for), so the difference is the client-side cost of
tracing plus the store writer's share of the CPU, not a different server reply. The untraced call goes through
the original `Completions.create`, saved before instrumentation wraps it.

Prints the mean and median per-call latency of each, the overhead per call (one span each) in microseconds, and
`ratio=<traced/untraced>` last (means of the paired calls).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import openai
from openai.resources.chat.completions import Completions

from lightning_sdk import tracing
from lightning_sdk.serving import CPUServer
from lightning_sdk.store import Store

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=400, help="pairs of calls (one traced, one untraced each)")
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--max-tokens", type=int, default=1)
args = p.parse_args()

plain_create = Completions.create  # before tracing.install wraps it
tmp = Path(tempfile.mkdtemp(prefix="ls-trace-bench-"))
with CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, log_path=tmp / "server.log") as server:
    store = Store(tmp / "store.sqlite")
    tracing.install(store)
    tracing.request_token_ids_from(server.base_url)
    client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
    body = dict(model="policy", messages=[{"role": "user", "content": "What is 3 + 4?"}], temperature=1.0,
                max_tokens=args.max_tokens, logprobs=True, extra_body={"return_token_ids": True})

    def untraced() -> float:
        t0 = time.perf_counter()
        plain_create(client.chat.completions, **body)
        return time.perf_counter() - t0

    def traced(i: int) -> float:
        t0 = time.perf_counter()
        with tracing.rollout_context(f"bench-{i}"):
            client.chat.completions.create(**body)
        return time.perf_counter() - t0

    for i in range(args.warmup):
        untraced(), traced(-i - 1)
    plain, spans = [], []
    for i in range(args.calls):
        if i % 2:
            plain.append(untraced())
            spans.append(traced(i))
        else:
            spans.append(traced(i))
            plain.append(untraced())
    t0 = time.perf_counter()
    tracing.flush()
    flush_s = time.perf_counter() - t0
    stored = store.count("spans")
    store.close()

us = 1e6
diffs = [s - u for s, u in zip(spans, plain)]
print(f"calls: {args.calls} pairs, max_tokens={args.max_tokens}, spans stored: {stored}, "
      f"final flush {flush_s * 1e3:.1f} ms")
print(f"untraced: mean {statistics.mean(plain) * us:.0f} us, median {statistics.median(plain) * us:.0f} us")
print(f"traced:   mean {statistics.mean(spans) * us:.0f} us, median {statistics.median(spans) * us:.0f} us")
print(f"overhead per call (one span): mean {statistics.mean(diffs) * us:.0f} us, "
      f"median of paired differences {statistics.median(diffs) * us:.0f} us")
print(f"ratio={statistics.mean(spans) / statistics.mean(plain):.4f}")
