"""Probes of issue 18 against a running server: how long /health stalls while a 15 MB message and caller chat
templates are handled, and how many of 300 half-open connections the server closes within 20 s.

    python -m lightning_sdk.engine --model builtin:tiny-arith --served-model-name policy --port 18777 \
        --threads 1 --max-model-len 128   # with LIGHTNING_SDK_SERVE_API_KEY=k in the environment
    python benchmarks/server_probes.py --port 18777 --key k
"""

from __future__ import annotations

import argparse
import selectors
import socket
import threading
import time

import httpx

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--key", required=True)
p.add_argument("--model", default="policy")
args = p.parse_args()
base, auth = f"http://127.0.0.1:{args.port}", {"Authorization": f"Bearer {args.key}"}
hi = [{"role": "user", "content": "hi"}]
for name, body in [
    ("15 MB message", {"messages": [{"role": "user", "content": "x " * (15 * 1024 * 1024 // 2 - 100)}]}),
    ("chat_template_kwargs", {"messages": hi, "chat_template_kwargs": {"x": 1}}),
    ("chat_template", {"messages": hi, "chat_template": "{% for a in range(10**8) %}{% endfor %}"}),
]:
    out: list = []

    def heavy(body=body):
        t = time.monotonic()
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": args.model, "max_tokens": 2, **body},
                       headers=auth, timeout=300)
        out.append((r.status_code, time.monotonic() - t))

    th, worst = threading.Thread(target=heavy), 0.0
    th.start()
    while th.is_alive():
        t = time.monotonic()
        httpx.get(f"{base}/health", timeout=300)
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.01)
    th.join()
    print(f"{name}: status {out[0][0]} after {out[0][1]:.2f}s; slowest /health meanwhile {worst:.2f}s")

socks = []
for _ in range(300):
    s = socket.create_connection(("127.0.0.1", args.port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    socks.append(s)
print("/health with 300 half-open connections:", httpx.get(f"{base}/health", timeout=30).status_code)
sel = selectors.DefaultSelector()
for s in socks:
    sel.register(s, selectors.EVENT_READ)
closed, t0 = 0, time.monotonic()
while closed < len(socks) and time.monotonic() - t0 < 20:
    for key, _ in sel.select(timeout=0.5):
        if not key.fileobj.recv(4096):
            sel.unregister(key.fileobj)
            closed += 1
print(f"half-open connections closed by the server within {time.monotonic() - t0:.1f}s: {closed} of {len(socks)}")
