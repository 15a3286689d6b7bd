"""What tracing costs an agent: OpenAI-client calls to the built-in server on loopback, traced vs untraced.

    python benchmarks/tracing_overhead.py --calls 400
    python benchmarks/tracing_overhead.py --calls 400 --otlp   # spans also exported over OTLP/HTTP

`--otlp` starts a local OTLP/HTTP receiver on 127.0.0.1 (it reads and discards each request) and exports every
span to it through the batch processor, as `run.otlp_endpoint` does.

One process, one server, one client. Each pair of calls makes one plain call and one traced call (inside a
rollout context, through opentelemetry-instrumentation-openai, our token-id wrapper, the span processor and the
SQLite store writer), in alternating order so drift on the shared machine cancels out. Both send the same request
body (logprobs and `return_token_ids`, which tracing asks for), so the difference is the client-side cost of
tracing plus the store writer's share of the CPU, not a different server reply. The untraced call goes through
the original `Completions.create`, saved before instrumentation wraps it.

Prints the mean and median per-call latency of each, the overhead per call (one span each) in microseconds, the
CPU time per span (the calling thread's extra CPU per traced call, and the span writer thread's CPU per span: far
less noisy than wall time on a shared machine), the client-side cost per span with the server's reply replayed
by an in-process httpx transport (no server: the floor of what tracing adds), and `ratio=<traced/untraced>` last
(mean wall time per call against the real server).
"""

import argparse
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
from openai.resources.chat.completions import Completions

from lightning_sdk import tracing
from lightning_sdk.serving.cpu import CPUServer
from lightning_sdk.store import Store

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=400, help="pairs of calls (one traced, one untraced each)")
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--max-tokens", type=int, default=1)
p.add_argument("--otlp", action="store_true", help="also export every span to a local OTLP/HTTP receiver")
args = p.parse_args()


class Sink(BaseHTTPRequestHandler):
    exported = 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Sink.exported += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


endpoint = None
if args.otlp:
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"

plain_create = Completions.create  # before tracing.install wraps it
tmp = Path(tempfile.mkdtemp(prefix="ls-trace-bench-"))
with CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, log_path=tmp / "server.log") as server:
    store = Store(tmp / "store.sqlite")
    tracing.install(store, otlp_endpoint=endpoint)
    tracing.request_token_ids_from(server.base_url)
    client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
    body = dict(model="policy", messages=[{"role": "user", "content": "What is 3 + 4?"}], temperature=1.0,
                max_tokens=args.max_tokens, logprobs=True, extra_body={"return_token_ids": True})

    cpu = {"plain": [], "spans": []}  # the calling thread's CPU time per call: what the agent's thread pays

    def untraced() -> float:
        c0, t0 = time.thread_time(), time.perf_counter()
        plain_create(client.chat.completions, **body)
        t1, c1 = time.perf_counter(), time.thread_time()
        cpu["plain"].append(c1 - c0)
        return t1 - t0

    def traced(i: int) -> float:
        c0, t0 = time.thread_time(), time.perf_counter()
        with tracing.rollout_context(f"bench-{i}"):
            client.chat.completions.create(**body)
        t1, c1 = time.perf_counter(), time.thread_time()
        cpu["spans"].append(c1 - c0)
        return t1 - t0

    for i in range(args.warmup):
        untraced(), traced(-i - 1)
    tracing.flush()
    cpu = {"plain": [], "spans": []}
    writer = time.pthread_getcpuclockid(tracing.instrument._state.processor._thread.ident)
    writer_cpu0 = time.clock_gettime(writer)
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
    writer_cpu = time.clock_gettime(writer) - writer_cpu0
    stored = store.count("spans")

    # The same two paths with the server's reply replayed by an in-process httpx transport: no network, no
    # server, so the difference is only what the client side of tracing costs (a floor, free of the noise).
    reply = plain_create(client.chat.completions, **body).model_dump(exclude_unset=True)
    canned = openai.OpenAI(base_url="http://canned.invalid/v1", api_key="EMPTY", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(
                               lambda request: httpx.Response(200, json=reply))))
    tracing.request_token_ids_from("http://canned.invalid/v1")
    iso = {"plain": [], "spans": []}
    for i in range(args.calls + args.warmup):
        for traced_call in ((False, True) if i % 2 else (True, False)):
            t0 = time.perf_counter()
            if traced_call:
                with tracing.rollout_context(f"canned-{i}"):
                    canned.chat.completions.create(**body)
            else:
                plain_create(canned.chat.completions, **body)
            if i >= args.warmup:
                iso["spans" if traced_call else "plain"].append(time.perf_counter() - t0)
    tracing.flush(exporters=True)
    store.close()

us = 1e6
diffs = [s - u for s, u in zip(spans, plain)]
print(f"calls: {args.calls} pairs, max_tokens={args.max_tokens}, spans stored: {stored}, "
      f"final flush {flush_s * 1e3:.1f} ms, OTLP export "
      + (f"on ({Sink.exported} export requests received, errors: {tracing.export_errors()})" if args.otlp else "off"))
print(f"untraced: mean {statistics.mean(plain) * us:.0f} us, median {statistics.median(plain) * us:.0f} us")
print(f"traced:   mean {statistics.mean(spans) * us:.0f} us, median {statistics.median(spans) * us:.0f} us")
print(f"overhead per call (one span): mean {statistics.mean(diffs) * us:.0f} us, "
      f"median of paired differences {statistics.median(diffs) * us:.0f} us")
agent_cpu = statistics.mean(cpu["spans"]) - statistics.mean(cpu["plain"])
print(f"CPU per span: calling thread +{agent_cpu * us:.0f} us (traced {statistics.mean(cpu['spans']) * us:.0f} vs "
      f"untraced {statistics.mean(cpu['plain']) * us:.0f} us per call), span writer thread "
      f"{writer_cpu / args.calls * us:.0f} us (deferred attributes, records, SQLite, export hand-off: off the calling thread)")
print(f"replayed reply (no server): untraced {statistics.median(iso['plain']) * us:.0f} us, traced "
      f"{statistics.median(iso['spans']) * us:.0f} us per call (medians): client-side cost "
      f"{(statistics.median(iso['spans']) - statistics.median(iso['plain'])) * us:.0f} us per span")
print(f"ratio={statistics.mean(spans) / statistics.mean(plain):.4f}")
