"""What a rollout's calls cost the store as its turns and prompts grow: bytes stored per rollout against its turns,
and the time per call at the gateway as the prompt grows to 32k tokens.

    python benchmarks/store_growth.py

A multi-turn agent re-sends its whole conversation each call, so call k's prompt holds every earlier prompt and
completion: a store that keeps each call's prompt (ids and messages) whole holds O(turns^2) of them a rollout.

The calls go through the real gateway (gateway/proxy.py, on 127.0.0.1, recording into a real Store) in front of a
stand-in backend (a stdlib HTTP server in a process of its own) that answers as the project's servers do: the
prompt's token ids (`prompt_token_ids`, a ChatML-like template over a word-level tokenizer, so that call k's ids
start with call k-1's prompt and completion ids, as a real chat template makes them), the completion's ids and
log-probs. Each rollout: a system + task prompt (~2k tokens), then each turn a completion (80-200 tokens) and a tool
observation (150-300 tokens).

1. Bytes. For 1, 2, 5, 10, 20 turns: `--rollouts` rollouts (distinct tasks) into a fresh store, which is then closed
   and VACUUMed; printed per rollout: the file's growth over an empty store's, the bytes of the rows (every column of
   the spans, and of the shared-chunk table where there is one), and the store's CPU: mean per call written (the
   records written again one at a time into a store of their own) and per rollout read back (`Store.spans`, as the
   trainer and the dashboard read one). Then `exponent=`: the least-squares slope of log(file bytes per rollout)
   over log(turns) (1: linear, 2: quadratic; the fixed system prompt pulls it below 1).
2. Time. Rollouts whose prompts reach 1k, 2k, 4k, 8k, 16k, 32k tokens (an observation sized to reach each), each
   call made through the gateway and, beside it, straight to the backend: the median wall time per call each way
   (the record is written on the gateway's writer thread, off the call's path), and the CPU this process spent on
   the call through the gateway (client, gateway, and the writing of its record: less noisy than wall time on a
   shared machine); then the store's CPU per record, the same records written again one at a time, and the bytes
   of the rows each one added.
"""

from __future__ import annotations

import argparse
import math
import random
import secrets
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.store import Store

p = argparse.ArgumentParser()
p.add_argument("--turns", type=int, nargs="+", default=[1, 2, 5, 10, 20])
p.add_argument("--rollouts", type=int, default=3, help="rollouts per turn count (distinct tasks)")
p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
p.add_argument("--repeats", type=int, default=9, help="rollouts of the time part (calls per size)")
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
if len(set(args.turns)) < 2 or min(args.turns) < 1:
    p.error("--turns: expected two or more different counts, each at least 1 (the exponent is fitted over them)")
if min(args.sizes) < 600 or args.sizes != sorted(set(args.sizes)):
    p.error("--sizes: expected prompt sizes in tokens, increasing, each at least 600")
if args.rollouts < 1 or args.repeats < 1:
    p.error("--rollouts and --repeats: expected at least 1")

# The stand-in backend: token i is the word "t<i>"; a message renders as <|im_start|> role content <|im_end|> (ids 1,
# role, content..., 2), the prompt ends with the generation prompt (1, assistant), the completion ends with 2.
BACKEND = r"""
import json, random, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
ROLE = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
cache = {}
def message_ids(m):
    key = (m.get("role"), m.get("content") or "")
    ids = cache.get(key)
    if ids is None:
        ids = [1, ROLE.get(key[0], 7)] + [int(w[1:]) for w in key[1].split()] + [2]
        if len(cache) > 100000:
            cache.clear()
        cache[key] = ids
    return ids
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        prompt = [i for m in body["messages"] for i in message_ids(m)] + [1, ROLE["assistant"]]
        rng = random.Random(len(prompt) * 7919 + len(body["messages"]))
        n = int(body.get("max_tokens") or 16)
        ids = [rng.randrange(100, 150000) for _ in range(n)]
        words = [f"t{i}" for i in ids]
        logprobs = [{"token": w, "logprob": -rng.random() * 4, "bytes": None, "top_logprobs": []}
                    for w in words + ["<|im_end|>"]]
        reply = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": body.get("model"),
                            "prompt_token_ids": prompt,
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(words)},
                                         "finish_reason": "stop", "token_ids": ids + [2],
                                         "logprobs": {"content": logprobs}}],
                            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n + 1,
                                      "total_tokens": len(prompt) + n + 1}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_port, flush=True)
s.serve_forever()
"""

rng = random.Random(args.seed)


def words(n: int) -> str:
    return " ".join(f"t{rng.randrange(100, 150000)}" for _ in range(n))


def rollout(http: httpx.Client, gateway: Gateway, store: Store, rollout_id: str, observations: list[int],
            *, system: int = 1500, direct: httpx.Client | None = None, timings: list | None = None) -> None:
    """One rollout of len(observations) calls; after call k an observation of observations[k] tokens."""
    key = secrets.token_hex(16)
    store.start_rollout(rollout_id, task_id=rollout_id, group_id=rollout_id, iteration=0, phase="train")
    gateway.rollouts.open(key, rollout_id)
    url = f"{gateway.rollout_base_url(key)}/chat/completions"
    messages = [{"role": "system", "content": words(system)}, {"role": "user", "content": words(500)}]
    try:
        for obs in observations:
            body = {"model": "policy", "messages": messages, "max_tokens": rng.randint(80, 200)}
            if direct is not None:  # the same request straight to the backend, beside the one through the gateway
                # untimed first: the stand-in tokenizes each message once, and neither timed call should pay it
                direct.post("/v1/chat/completions", json={**body, "max_tokens": 1}).raise_for_status()
                first_direct = rng.random() < 0.5  # either way first, by chance: both see the same drift
                if first_direct:
                    t0 = time.perf_counter()
                    straight = direct.post("/v1/chat/completions", json=body)
                    t_direct = time.perf_counter() - t0
            c0, t0 = time.process_time(), time.perf_counter()
            r = http.post(url, json=body)
            t_gateway = time.perf_counter() - t0
            if timings is not None:  # the record written too: its CPU is the call's
                gateway.capture.flush()
            cpu = time.process_time() - c0
            r.raise_for_status()
            if direct is not None:
                if not first_direct:
                    t0 = time.perf_counter()
                    straight = direct.post("/v1/chat/completions", json=body)
                    t_direct = time.perf_counter() - t0
                straight.raise_for_status()
            reply = r.json()["choices"][0]["message"]["content"]
            if timings is not None:
                timings.append((len(straight.json()["prompt_token_ids"]), t_gateway, t_direct, cpu))
            messages = messages + [{"role": "assistant", "content": reply},
                                   {"role": "tool", "tool_call_id": f"call_{len(messages)}", "content": words(obs)}]
    finally:
        gateway.rollouts.close(key)
    store.finish_rollout(rollout_id, status="succeeded", reward=1.0)


def rewritten(records: list, path: Path, *, sizes: bool = False) -> tuple[list[float], list[int]]:
    """The records written again one at a time, in order, into a store of their own at `path`: the CPU seconds of
    each `Store.write_calls` (this thread's: SQLite works in it; CPU, not wall, so that the other jobs of a shared
    machine count less), and (with `sizes`) the bytes of the rows each added. One at a time: the gateway's writer
    thread batches whatever has queued up, which would hide a record's own cost."""
    again = Store(path)
    seconds, stored = [], []
    for record in records:
        held = row_bytes(path) if sizes else 0
        t0 = time.thread_time()
        again.write_calls([record])
        seconds.append(time.thread_time() - t0)
        if sizes:
            stored.append(row_bytes(path) - held)
    again.close()
    return seconds, stored


def vacuumed_size(path: Path) -> int:
    db = sqlite3.connect(path)
    db.execute("VACUUM")
    db.close()
    return path.stat().st_size


def row_bytes(path: Path) -> int:
    """Bytes of every column of the spans, and of the shared chunks where the store has them."""
    db = sqlite3.connect(path)
    try:
        total = 0
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table in ("spans", "chunks"):
            if table in tables:
                cols = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
                total += db.execute("SELECT COALESCE(SUM(" + " + ".join(
                    f"COALESCE(length(CAST({c} AS BLOB)), 0)" for c in cols) + f"), 0) FROM {table}").fetchone()[0]
        return total
    finally:
        db.close()


tmp = Path(tempfile.mkdtemp(prefix="ls-store-growth-"))
proc = subprocess.Popen([sys.executable, "-c", BACKEND], stdout=subprocess.PIPE, text=True)
backend = f"http://127.0.0.1:{int(proc.stdout.readline())}"
gateway = Gateway(api_key="bench")
gateway.start([backend], backend_key=None)
gateway.policy = "policy"
http = httpx.Client(headers={"Authorization": "Bearer bench"}, timeout=120)
direct = httpx.Client(base_url=backend, timeout=120)
try:
    # ---- 1. bytes per rollout against turns
    empty = tmp / "empty.sqlite"
    Store(empty).close()
    base = vacuumed_size(empty)
    rows = []
    print(f"{'turns':>5} {'last prompt':>11} {'file bytes/rollout':>18} {'row bytes/rollout':>17} {'calls':>5} "
          f"{'write cpu ms/call':>17} {'read cpu ms/rollout':>17}")
    for turns in args.turns:
        path = tmp / f"turns{turns}.sqlite"
        store = Store(path)
        gateway.capture.record_to(store)
        for k in range(args.rollouts):
            rollout(http, gateway, store, f"r{turns}-{k}", [rng.randint(150, 300) for _ in range(turns)])
        assert gateway.capture.flush(), gateway.capture.errors
        gateway.capture.record_to(None)
        calls = store.count("spans")
        last = max(len(s.attributes["lightning.llm.prompt_token_ids"]) for s in store.spans(f"r{turns}-0"))
        t0 = time.thread_time()
        records = [r for k in range(args.rollouts) for r in store.spans(f"r{turns}-{k}")]
        read_ms = (time.thread_time() - t0) / args.rollouts * 1e3
        store.close()
        size = (vacuumed_size(path) - base) / args.rollouts
        data = row_bytes(path) / args.rollouts
        rows.append((turns, size, data))
        write_ms = statistics.mean(rewritten(records, tmp / f"again{turns}.sqlite")[0]) * 1e3
        print(f"{turns:>5} {last:>11} {size:>18,.0f} {data:>17,.0f} {calls:>5} {write_ms:>17.2f} {read_ms:>17.2f}")
    xs = [math.log(t) for t, _, _ in rows]
    fit = {}
    for i, name in ((1, "file"), (2, "rows")):
        ys = [math.log(r[i]) for r in rows]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        fit[name] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"bytes per rollout ~ turns^k: file k={fit['file']:.3f}, rows k={fit['rows']:.3f}")

    # ---- 2. time per call as the prompt grows
    store = Store(tmp / "time.sqlite")
    gateway.capture.record_to(store)
    timings: list = []
    marks = []
    for k in range(args.repeats + 1):  # the first one warms up
        # the system + task prompt is the first size; each observation then brings the prompt to the next one
        first = args.sizes[0]
        obs, have = [], first
        for size in args.sizes[1:]:
            obs.append(max(1, size - have - 150))
            have = size
        before = len(timings)
        rollout(http, gateway, store, f"t{k}", obs + [1], system=max(1, first - 510), direct=direct,
                timings=timings)
        assert gateway.capture.flush(), gateway.capture.errors
        marks.append((before, len(timings)))
    gateway.capture.record_to(None)
    writes, stored = rewritten([r for k in range(args.repeats + 1) for r in store.spans(f"t{k}")],
                               tmp / "again.sqlite", sizes=True)
    store.close()
    print(f"{'prompt tokens':>13} {'gateway ms':>10} {'direct ms':>9} {'hop ms':>7} {'gateway cpu ms':>14} "
          f"{'store write cpu ms':>18} {'row bytes':>10}")
    # the calls of one place in the rollouts (first call, second, ...) have about the same prompt length
    per_place = list(zip(*[range(a, b) for a, b in marks[1:]]))
    for place in per_place:
        n = statistics.median(timings[i][0] for i in place)
        g = statistics.median(timings[i][1] for i in place) * 1e3
        d = statistics.median(timings[i][2] for i in place) * 1e3
        c = statistics.median(timings[i][3] for i in place) * 1e3
        w = statistics.median(writes[i] for i in place) * 1e3
        b = statistics.median(stored[i] for i in place)
        print(f"{n:>13,.0f} {g:>10.2f} {d:>9.2f} {g - d:>7.2f} {c:>14.2f} {w:>18.2f} {b:>10,.0f}")
    print(f"store_growth: turns={rows[-1][0]} file_bytes_per_rollout={rows[-1][1]:.0f} "
          f"exponent={fit['file']:.3f} rows_exponent={fit['rows']:.3f}")
finally:
    http.close()
    direct.close()
    gateway.stop()
    proc.terminate()
    proc.wait()
