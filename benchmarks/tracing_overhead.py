"""What tracing costs the agent's thread per OpenAI-client call, with OTLP export off and on, in one run.

    python benchmarks/tracing_overhead.py --calls 400
    python benchmarks/tracing_overhead.py --calls 400 --max-tokens 32   # longer replies (more log-probs to parse)

One process makes the calls; the built-in server and an OTLP/HTTP receiver (it reads and discards each export
request) run in processes of their own, so only tracing's threads share the agent's GIL. The run alternates
phases with export off and on (`tracing.install` swaps the span processor between them). Each round of a phase
makes three calls, in rotating order so drift on a shared machine cancels out:
- untraced: the original `Completions.create` (saved before instrumentation wraps it) with the agent's request;
- untraced, with the request tracing sends (`logprobs`, `return_token_ids` added): what the bigger reply costs
  the client to parse;
- traced: the agent's request inside a rollout context, through opentelemetry-instrumentation-openai, our
  token-id wrapper and the span processor; the span writer thread stores it in SQLite and, with export on, hands
  it to the OTLP batch processor.

Printed per mode:
- the calling thread's CPU per call (`time.thread_time` around it): traced minus untraced is what tracing costs
  the agent's thread, the bigger reply's parse included. It is the agent's own CPU only: time it waits for the
  GIL while tracing's threads hold it is not in it, but is in the wall time;
- wall time per call: traced minus untraced holds the calling thread's extra CPU, the server's and the client's
  extra work for the bigger reply, and the GIL waits tracing's threads caused (noisy on a shared machine);
- the CPU of the span writer thread and of OTLP export per span: work moved off the agent's thread, which still
  runs in its process and holds the GIL while it runs. Most of it falls while the agent waits for its server
  (the GIL is free then); what falls while the agent wants the GIL shows as wall time, not as calling-thread CPU;
- the calling thread's extra CPU with the server's reply replayed by an in-process httpx transport (no network,
  no server: the least noisy figure), and, there, the GIL time tracing's threads take from an agent that never
  waits for I/O (the worst case): its wall time beyond its CPU with the span writer working alongside it, minus
  the same with the writer held until the end of each phase;
- `ratio=<traced/untraced mean wall time, export off> ratio_otlp=<the same with export on>` last.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from openai.resources.chat.completions import Completions

from lightning_sdk import tracing
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.store import Store

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=400, help="rounds per mode (three calls each: two untraced, one traced)")
p.add_argument("--phases", type=int, default=4, help="phases per mode; export off and on alternate")
p.add_argument("--warmup", type=int, default=30, help="unmeasured rounds per mode before the first phase")
p.add_argument("--max-tokens", type=int, default=1)
args = p.parse_args()

RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

MODES = ("off", "on")
US = 1e6
plain_create = Completions.create  # before tracing.install wraps it
tmp = Path(tempfile.mkdtemp(prefix="ls-trace-bench-"))
receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
endpoint = f"http://127.0.0.1:{receiver.stdout.readline().strip()}"
agent_body = dict(model="policy", messages=[{"role": "user", "content": "What is 3 + 4?"}], temperature=1.0,
                  max_tokens=args.max_tokens)
traced_body = dict(agent_body, logprobs=True, extra_body={"return_token_ids": True})  # as tracing sends it


def thread_cpu(t: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


class Results:
    def __init__(self):
        self.cpu = {k: [] for k in ("plain", "plain_ids", "traced")}
        self.wall = {k: [] for k in ("plain", "plain_ids", "traced")}
        self.threads = {"lightning-span-writer": 0.0, "OtelBatchSpanRecordProcessor": 0.0}
        self.spans = 0
        self.flush_cpu = 0.0  # the calling thread's CPU in the flush after each phase
        self.writer_in_phase = 0.0  # the span writer's CPU during the phases (the rest: in the flush after each)


def run(client: openai.OpenAI, store: Store, variants: dict[str, tuple[str, bool]], rounds: int, phases: int,
        warmup: int, tag: str) -> dict[str, Results]:
    """Phases of `rounds // phases` rounds for each variant in turn; a variant is (export "off" or "on", held):
    held, the span writer thread waits for the flush at the end of each phase instead of working during it."""
    out = {v: Results() for v in variants}

    def call(kind: str, i: int, res: Results | None) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        if kind == "traced":
            with tracing.rollout_context(f"{tag}-{i}"):
                client.chat.completions.create(**agent_body)
        else:
            plain_create(client.chat.completions, **(agent_body if kind == "plain" else traced_body))
        t1, c1 = time.perf_counter(), time.thread_time()
        if res is not None:
            res.cpu[kind].append(c1 - c0)
            res.wall[kind].append(t1 - t0)

    kinds = ("plain", "plain_ids", "traced")
    n = 0
    for phase in range(-1, phases):
        for variant, (mode, held) in variants.items():
            tracing.install(store, otlp_endpoint=endpoint if mode == "on" else None)
            if held:
                tracing.instrument._state.processor._interval = 3600.0  # it wakes on the flush
            res = out[variant] if phase >= 0 else None
            threads = [t for t in threading.enumerate() if res is not None and t.name in res.threads]
            cpu0 = {t: thread_cpu(t) for t in threads}
            for i in range(rounds // phases if phase >= 0 else warmup):
                n += 1
                for k in kinds[n % 3:] + kinds[:n % 3]:
                    call(k, n, res)
            if res is not None:
                res.writer_in_phase += sum(thread_cpu(t) - cpu0[t] for t in threads if "writer" in t.name)
            c0 = time.thread_time()
            tracing.flush(exporters=True)  # with export on, the batch processor encodes and posts here
            if res is not None:
                res.flush_cpu += time.thread_time() - c0
                res.spans += rounds // phases
                for t in threads:
                    res.threads[t.name] += thread_cpu(t) - cpu0[t]
    tracing.flush(exporters=True)
    return out


with CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, log_path=tmp / "server.log") as server:
    store = Store(tmp / "store.sqlite")
    tracing.install(store)
    tracing.request_token_ids_from(server.base_url)
    client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
    live = run(client, store, {m: (m, False) for m in MODES}, args.calls, args.phases, args.warmup, "bench")
    stored = store.count("spans")
    errors = tracing.export_errors() + tracing.writer_errors()

    # The same with the server's reply replayed by an in-process httpx transport: no network, no server, so
    # the difference is only what the client side of tracing costs (the least noisy figure).
    replies = {b is traced_body: plain_create(client.chat.completions, **b).model_dump(exclude_unset=True)
               for b in (agent_body, traced_body)}

    def replay(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=replies["return_token_ids" in json.loads(request.content)])

    canned = openai.OpenAI(base_url="http://canned.invalid/v1", api_key="EMPTY", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(replay)))
    tracing.request_token_ids_from("http://canned.invalid/v1")
    replayed = run(canned, store, {v: (v.split()[0], "held" in v) for m in MODES for v in (m, f"{m} held")},
                   args.calls, args.phases, args.warmup, "canned")
    store.close()
receiver.terminate()


def mean_us(xs: list[float]) -> float:
    return statistics.mean(xs) * US


print(f"{args.calls} rounds per mode (3 calls each) in {args.phases} phases per mode, max_tokens={args.max_tokens}; "
      f"spans stored: {stored}; export and writer errors: {errors or 'none'}")
figures = {}
for mode in MODES:
    r = live[mode]
    cpu = {k: mean_us(v) for k, v in r.cpu.items()}
    wall = {k: mean_us(v) for k, v in r.wall.items()}
    diffs = [t - u for t, u in zip(r.wall["traced"], r.wall["plain"])]
    iso = replayed[mode].cpu
    figures[mode] = cpu["traced"] - cpu["plain"]
    bigger = {"cpu": cpu["plain_ids"] - cpu["plain"], "wall": wall["plain_ids"] - wall["plain"]}
    print(f"export {mode}:")
    print(f"  calling-thread CPU per call: untraced {cpu['plain']:.0f} us, untraced with tracing's request "
          f"{cpu['plain_ids']:.0f} us, traced {cpu['traced']:.0f} us -> tracing costs the agent's thread "
          f"+{figures[mode]:.0f} us per call, of which parsing the bigger reply {bigger['cpu']:+.0f} us")
    print(f"  wall per call: untraced mean {wall['plain']:.0f} us (median {statistics.median(r.wall['plain']) * US:.0f}), "
          f"traced mean {wall['traced']:.0f} us (median {statistics.median(r.wall['traced']) * US:.0f}); "
          f"traced - untraced: mean {statistics.mean(diffs) * US:+.0f} us, median of pairs "
          f"{statistics.median(diffs) * US:+.0f} us (the bigger reply alone: {bigger['wall']:+.0f} us)")
    export_cpu = (r.threads["OtelBatchSpanRecordProcessor"] + r.flush_cpu) / r.spans * US
    print(f"  off the calling thread, CPU per span: span writer {r.threads['lightning-span-writer'] / r.spans * US:.0f} us"
          + (f", OTLP export {export_cpu:.0f} us (encoding and posting: the batch processor's thread every 5 s or "
             f"512 spans in a run, the flush after each phase here)" if mode == "on" else ""))
    waits = {k: (sum(res.wall["traced"] + res.wall["plain"] + res.wall["plain_ids"])
                 - sum(res.cpu["traced"] + res.cpu["plain"] + res.cpu["plain_ids"])) / res.spans * US
             for k, res in (("running", replayed[mode]), ("held", replayed[f"{mode} held"]))}
    print(f"  replayed reply (no server: the agent's thread never waits for I/O): calling-thread CPU untraced "
          f"{mean_us(iso['plain']):.0f} us, traced {mean_us(iso['traced']):.0f} us -> "
          f"{mean_us(iso['traced']) - mean_us(iso['plain']):+.0f} us per call (medians: "
          f"{(statistics.median(iso['traced']) - statistics.median(iso['plain'])) * US:+.0f} us; a full garbage "
          f"collection, ~0.1 s here, moves a mean by hundreds of us); its wall time beyond its CPU per "
          f"traced call: {waits['running']:.0f} us with the writer working alongside, {waits['held']:.0f} us with "
          f"it held until the phase ends -> the GIL time tracing's threads took from it: "
          f"{waits['running'] - waits['held']:+.0f} us per span, while the writer spent "
          f"{replayed[mode].writer_in_phase / replayed[mode].spans * US:.0f} us of CPU per span alongside it")
print(f"calling thread per traced call: +{figures['off']:.0f} us export off, +{figures['on']:.0f} us export on")
ratio = {m: statistics.mean(live[m].wall["traced"]) / statistics.mean(live[m].wall["plain"]) for m in MODES}
print(f"ratio={ratio['off']:.4f} ratio_otlp={ratio['on']:.4f}")
