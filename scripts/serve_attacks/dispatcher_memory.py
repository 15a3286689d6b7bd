"""Issue 52 item 10, the remote dispatcher's memory, measured against whichever checkout is on PYTHONPATH:

a gateway with the remote runtime's work routes (the `lightning run` server's: Gateway, Dispatch, work_router, a
Store) is built in this process, and a client in a child process posts results for rollouts nobody holds, each
under a random worker name, over one loopback connection: 20,000, then 40,000 more. This process's RSS (psutil)
is read after each part (gc.collect() first), so the client's own memory is not counted; names kept is the length
of the dispatcher's map of worker names.

Only the gateway's process is measured: a `lightning run` loads its trainer just after it prints that it waits for
workers, so its RSS read then and later grows by the trainer's start-up (hundreds of MiB in seconds, with no
request at all), which is not the results'.

Run: PYTHONPATH=<checkout> python scripts/serve_attacks/dispatcher_memory.py   (about 1.5 minutes)
"""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

FIRST, MORE = 20_000, 40_000
WORKER_KEY = "workers"

CLIENT = r'''
import secrets, sys
import httpx
url, key, start, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
codes = {}
with httpx.Client(base_url=url, timeout=60) as c:
    for i in range(start, start + n):
        name = "w" if start < 0 else f"w-{secrets.token_hex(16)}"
        r = c.post(f"/v1/work/gone-{i}/result", headers={"Authorization": f"Bearer {key}"},
                   json={"worker": name, "status": "succeeded", "reward": 1.0})
        codes[r.status_code] = codes.get(r.status_code, 0) + 1
print(codes)
'''


def send(url: str, start: int, n: int) -> str:
    """Post `n` bogus results from a child process (random worker names, unless `start` < 0); its status counts."""
    done = subprocess.run([sys.executable, "-c", CLIENT, url, WORKER_KEY, str(start), str(n)], capture_output=True,
                          text=True, timeout=600)
    return done.stdout.strip() or done.stderr.strip()[-300:]


def rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def closed_port() -> str:
    """A backend address nobody listens on: bogus results never reach a model server."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def main() -> None:
    from lightning_sdk.gateway.proxy import Gateway
    from lightning_sdk.rollouts.remote.dispatch import Dispatch
    from lightning_sdk.rollouts.remote.routes import work_router
    from lightning_sdk.store import Store

    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d) / "store.sqlite")
        dispatch = Dispatch(store)
        gateway = Gateway(api_key="agents", rollouts=dispatch.rollouts)
        gateway.add_routes(work_router(dispatch, run_name="memory", api_key="agents", redirect_openai=True),
                           api_key=WORKER_KEY)
        gateway.start([closed_port()], backend_key=None)
        try:
            send(gateway.url, -1_000, 1_000)  # warm-up under one name: code paths loaded, caches filled
            base = rss_mib()
            first = send(gateway.url, 0, FIRST)
            after_first = rss_mib()
            more = send(gateway.url, FIRST, MORE)
            after_more = rss_mib()
        finally:
            gateway.stop()
            store.close()
    print(f"answers: {first} then {more}", file=sys.stderr)
    serving.emit(10, f"{FIRST:,} bogus results under random worker names (the work routes in process): RSS growth, "
                     f"then over {MORE:,} more; names kept",
                 f"+{after_first - base:.1f} MiB, then +{after_more - after_first:.1f} MiB; "
                 f"{len(dispatch.seen):,} names")


if __name__ == "__main__":
    main()
