"""What tracing costs now that the gateway makes each call's record: the agent's thread, and the gateway.

    python benchmarks/tracing_overhead.py --calls 400

1. The agent's thread. A stand-in gateway (a stdlib HTTP server in its own process that answers every request
   with the same chat completion and an `x-lightning-call-id`) takes OpenAI-client calls from this process. Rounds
   alternate, in rotating order so drift on a shared machine cancels out: a call outside any rollout (nothing is
   added), and a call inside a rollout and a component (entered once, as an agent's episode is; traceparent and
   baggage injected by tracing/propagation.py, the reply's call id kept). Printed: the calling thread's CPU per
   call (`time.thread_time`) and wall time per call both ways; `agent_us=<traced - untraced CPU per call, in
   microseconds>` and `ratio=<traced / untraced mean wall time>`.
2. The gateway. The real gateway in front of the real built-in server; the same calls inside rollouts, in phases
   that alternate recording on (records written to a SQLite store by the gateway's writer thread) and off; in
   every phase each call through the gateway is paired with one straight to the server, in rotating order (as a
   sequential agent makes them, one at a time), so that both see the same drift in the server's speed.
   Printed: wall time per call each way, `gateway_ratio=<wall per call, recording off / on>`, and the writer's
   CPU per record (`Call.record` and the store write, timed on the recorded calls afterwards: `record_us`).
   `hop_ms=<median wall per call through the gateway (recording on) - straight to the server, in the same
   phases>` is the hop's latency, in brackets its 95% interval over the rounds (bootstrap: one run's reach on this
   machine), then `paired=<median of the rounds' differences>` (each call through the gateway less the call
   straight to the server beside it: the drift between rounds cancels), and `hop_cpu_us` the CPU it costs this
   process per call (the gateway's threads, the records' writing included): on a loaded machine the wall-clock hop
   is mostly waiting for a core, the CPU is not. `--apart`: the gateway served from a process of its own, as the
   in-process runtime serves it (gateway/isolated.py); `hop_cpu_us` then counts that process's CPU too.
"""

import argparse
import contextvars
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import psutil

import lightning_sdk as ls
from lightning_sdk import tracing
from lightning_sdk.gateway.isolated import IsolatedGateway
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.store import Store

from interval import bootstrap

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=400, help="rounds per part (two calls each: untraced, traced)")
p.add_argument("--phases", type=int, default=4, help="phases of the gateway part; recording on and off alternate")
p.add_argument("--warmup", type=int, default=30)
p.add_argument("--apart", action="store_true",
               help="the gateway served from a process of its own, as the in-process runtime serves it "
                    "(gateway/isolated.py); hop_cpu_us then adds that process's CPU")
args = p.parse_args()

STAND_IN = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
REPLY = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "5"}, "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}).encode()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body in two writes: no delayed ACK between them
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(REPLY)))
        self.send_header("x-lightning-call-id", "0123456789abcdef")
        self.end_headers()
        self.wfile.write(REPLY)
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_port, flush=True)
s.serve_forever()
"""
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
tmp = Path(tempfile.mkdtemp(prefix="ls-tracing-bench-"))
store = Store(tmp / "store.sqlite")


def timed(fn) -> tuple[float, float]:
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c0, time.perf_counter() - w0


def rounds(n: int, plain, traced) -> dict[str, list[tuple[float, float]]]:
    out = {"untraced": [], "traced": []}
    for k in range(n):
        order = [("untraced", plain), ("traced", traced)]
        for name, fn in order[k % 2:] + order[:k % 2]:
            out[name].append(timed(fn))
    return out


def in_rollout(fn, gateway: Gateway | None = None):
    """`fn` called inside one rollout and component, entered once (an agent makes its calls inside an episode)."""
    trace_id = secrets.token_hex(16)
    if gateway is not None:
        gateway.rollouts.open(trace_id, "bench")
    ctx = contextvars.Context()

    def enter():
        tracing.rollout_context("bench", trace_id=trace_id).__enter__()
        ls.component("solver").__enter__()

    ctx.run(enter)
    return lambda: ctx.run(fn)


# ---- 1. the agent's thread
proc = subprocess.Popen([sys.executable, "-c", STAND_IN], stdout=subprocess.PIPE, text=True)
url = f"http://127.0.0.1:{int(proc.stdout.readline())}/v1"
tracing.install(store, gateway_url=url)
client = openai.OpenAI(base_url=url, api_key="bench", max_retries=0)
ask = lambda: client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=1)  # noqa: E731
rounds(args.warmup, ask, in_rollout(ask))
agent = rounds(args.calls, ask, in_rollout(ask))
proc.terminate()
cpu = {k: statistics.mean(c for c, _ in v) * 1e6 for k, v in agent.items()}
wall = {k: statistics.mean(w for _, w in v) * 1e6 for k, v in agent.items()}
for k in agent:
    print(f"agent, {k:>8}: {cpu[k]:7.1f} us calling-thread CPU, {wall[k]:7.1f} us wall per call "
          f"(median {statistics.median(w for _, w in agent[k]) * 1e6:.1f})")

# ---- 2. the gateway
with CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, log_path=tmp / "server.log") as server:
    gateway = IsolatedGateway(api_key="bench") if args.apart else Gateway(api_key="bench")
    gateway.start([server.url], backend_key=server.api_key, grammar=server.grammar)
    serving = psutil.Process(gateway.pid) if args.apart else None

    def cpu_now() -> float:
        """This process's CPU, and the gateway's process's with --apart."""
        theirs = sum(serving.cpu_times()[:2]) if serving is not None else 0.0
        return time.process_time() + theirs

    gateway.policy = "policy"
    tracing.install(store, gateway_url=gateway.base_url)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="bench", max_retries=0)
    ask = in_rollout(lambda: client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=4),
                     gateway)
    straight = openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none", max_retries=0)
    ask_server = lambda: straight.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)  # noqa
    per_phase = max(1, args.calls // args.phases)
    rounds(args.warmup, ask, ask_server)
    # Each phase (recording on or off) is rounds of one call through the gateway and one straight to the server, in
    # rotating order: the server's speed drifts over seconds on a shared machine, and both ways see the same drift.
    # "direct on": the direct calls made between recording calls, the hop's reference
    gw: dict[str, list[float]] = {"on": [], "off": [], "direct on": [], "direct off": []}
    cpu_s = {"on": 0.0, "direct on": 0.0}  # this process's CPU (the client's thread and the gateway's), recording on
    for phase in range(args.phases * 2):
        mode = ("on", "off")[phase % 2]
        gateway.capture.record_to(store if mode == "on" else None)
        for k in range(per_phase):
            order = [(mode, ask), (f"direct {mode}", ask_server)]
            for way, fn in order[k % 2:] + order[:k % 2]:
                c0 = cpu_now()
                gw[way].append(timed(fn)[1])
                if mode == "on":
                    cpu_s[way] += cpu_now() - c0
        if mode == "on":
            c0 = cpu_now()
            gateway.capture.flush()  # the records' writing counts against the calls that made them
            cpu_s["on"] += cpu_now() - c0
    gateway.capture.record_to(store)
    assert gateway.capture.flush()
    # a reply as the backend sends it to the gateway, for the writer's part below
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=4, logprobs=True,
                                           extra_body={"return_token_ids": True}).model_dump()
    gateway.stop()

# The writer's work per record, on calls like the ones recorded: Call.record and one batched store write.
from lightning_sdk.gateway.capture import Capture, OpenRollouts, Origin  # noqa: E402

capture = Capture(OpenRollouts())
calls = []
for _ in range(args.calls):
    c = capture.begin(Origin(None, "0" * 32, None, "solver"), "chat.completions",
                      {"model": "policy", "messages": MESSAGES, "temperature": 1.0, "top_p": 1.0}, asked="gpt-4o-mini",
                      policy="policy")
    c.whole(reply)
    calls.append(c)
c0 = time.thread_time()
records = [c.record() for c in calls]
for k in range(0, len(records), 64):
    store.write_calls(records[k:k + 64])
record_us = (time.thread_time() - c0) / len(records) * 1e6
store.close()

on, off = statistics.mean(gw["on"]) * 1e6, statistics.mean(gw["off"]) * 1e6
print(f"gateway, recording on : {on:8.1f} us wall per call (median {statistics.median(gw['on']) * 1e6:.1f})")
print(f"gateway, recording off: {off:8.1f} us wall per call (median {statistics.median(gw['off']) * 1e6:.1f})")
direct = gw["direct on"] + gw["direct off"]
print(f"server, direct         : {statistics.mean(direct) * 1e6:8.1f} us wall per call (median "
      f"{statistics.median(direct) * 1e6:.1f})")
hop = lambda a, b: (statistics.median(a) - statistics.median(b)) * 1e3  # noqa: E731
lo, hi = bootstrap(hop, gw["on"], gw["direct on"], paired=True)
paired = statistics.median(a - b for a, b in zip(gw["on"], gw["direct on"])) * 1e3
print(f"hop_ms={hop(gw['on'], gw['direct on']):.2f} [{lo:.2f}, {hi:.2f}]  paired={paired:.2f}  (median wall per call, "
      f"through the gateway recording - straight to the server; its 95% interval; the median of the rounds' "
      f"differences)")
print(f"hop_cpu_us={(cpu_s['on'] - cpu_s['direct on']) / (per_phase * args.phases) * 1e6:.0f}  (this process's CPU per "
      f"call, through the gateway recording - straight to the server: the gateway's own work, whatever the load; the "
      f"writer's batches count where they fall)")
print(f"record_us={record_us:.1f}  (the gateway writer's CPU per record: Call.record + the batched store write)")
print(f"gateway_ratio={off / on:.3f}  (wall per call through the gateway, recording off / on)")
print(f"agent_us={cpu['traced'] - cpu['untraced']:.1f}  (calling-thread CPU per call, in a rollout - outside one)")
print(f"ratio={wall['traced'] / wall['untraced']:.3f}  (wall per call, traced / untraced, against the stand-in)")
