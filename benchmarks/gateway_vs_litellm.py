"""Our gateway against LiteLLM's proxy, in front of the same built-in server, in the same run.

    python -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install "litellm[proxy]"
    python benchmarks/gateway_vs_litellm.py --litellm /tmp/litellm-venv/bin/litellm --calls 150 --runs 3

Three ways to the one server (`builtin:tiny-arith`, one torch thread): straight to it (`direct`), through our
gateway (`ours`: recording every call to a SQLite store, each call in an open rollout through its per-rollout
URL, as a `lightning run` does) and through LiteLLM's proxy (`litellm`: configured the way its docs show, a
config.yaml `model_list` entry `openai/<name>` with the server as `api_base`, a `master_key`, started with its
CLI; it records nothing). Each proxy runs in a process of its own, so that its CPU per call is read from
/proc and the client in this process is the same for all three.

Per run:
1. One call at a time (a sequential agent on a kept-alive connection): rounds of one call each way, in rotating
   order; the hop (median wall per call through the proxy - direct) for each proxy, and each proxy process's
   CPU per call (from /proc: clock ticks summed over its calls).
2. `--concurrency` calls at once (async clients, one connection each): `--calls` calls each way, the ways in
   rotating order; calls/s, the ratio to direct, and each proxy process's CPU per call over the burst.
`--runs` runs; each figure is printed per run and as median [min, max] over runs. Last:
`hop_ratio=<our hop / LiteLLM's>` and `throughput_ratio=<our calls/s / LiteLLM's>` (medians over runs).
LiteLLM is installed in a virtual environment of its own, never in the project's: it pins many packages.
"""

import argparse
import asyncio
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from lightning_sdk.servers.cpu import CPUServer

p = argparse.ArgumentParser()
p.add_argument("--litellm", required=True, help="LiteLLM's CLI (the `litellm` script of its own venv)")
p.add_argument("--calls", type=int, default=150, help="calls each way per part and run")
p.add_argument("--runs", type=int, default=3)
p.add_argument("--concurrency", type=int, default=16)
p.add_argument("--max-tokens", type=int, default=4)
p.add_argument("--warmup", type=int, default=20)
args = p.parse_args()

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
KEY = "sk-bench-" + secrets.token_hex(8)
OURS = """
import sys, time
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.store import Store
backend, backend_key, store_path, key, trace_id = sys.argv[1:6]
gateway = Gateway(api_key=key)
gateway.start([backend], backend_key=backend_key or None)
gateway.policy = "policy"
gateway.capture.record_to(Store(store_path))
gateway.rollouts.open(trace_id, "bench")
print(gateway.url, flush=True)
sys.stdin.read()  # until the benchmark closes it
assert gateway.capture.flush()
print(gateway.capture.recorded, flush=True)
gateway.stop()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout:.0f}s; see {log}")


def spread(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


tmp = Path(tempfile.mkdtemp(prefix="ls-vs-litellm-"))
with CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, log_path=tmp / "server.log") as server:
    trace_id = secrets.token_hex(16)
    ours_proc = subprocess.Popen([sys.executable, "-c", OURS, server.url, server.api_key or "", str(tmp / "store.sqlite"),
                                  KEY, trace_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ours_url = f"{ours_proc.stdout.readline().strip()}/rollouts/{trace_id}/v1"

    # LiteLLM as its docs show: a model_list entry for an OpenAI-compatible server, a master key, its CLI.
    port = free_port()
    (tmp / "litellm.yaml").write_text(
        "model_list:\n"
        "  - model_name: policy\n"
        "    litellm_params:\n"
        "      model: openai/policy\n"
        f"      api_base: {server.base_url}\n"
        "      api_key: os.environ/BACKEND_API_KEY\n"
        "general_settings:\n"
        "  master_key: os.environ/LITELLM_MASTER_KEY\n")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "BACKEND_API_KEY": server.api_key or "none",
           "LITELLM_MASTER_KEY": KEY, "LITELLM_LOG": "ERROR"}
    with open(tmp / "litellm.log", "w") as litellm_log:
        theirs_proc = subprocess.Popen([args.litellm, "--config", str(tmp / "litellm.yaml"), "--host", "127.0.0.1",
                                        "--port", str(port)], env=env, stdout=litellm_log, stderr=subprocess.STDOUT)
    theirs_root = f"http://127.0.0.1:{port}"
    wait_ready(f"{theirs_root}/health/liveliness", theirs_proc, tmp / "litellm.log")
    targets = {"direct": (server.base_url, server.api_key or "none", None),
               "ours": (ours_url, KEY, ours_proc.pid), "litellm": (f"{theirs_root}/v1", KEY, theirs_proc.pid)}

    def sync_call(client: openai.OpenAI) -> None:
        r = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=args.max_tokens,
                                           temperature=1.0)
        assert r.choices[0].message is not None

    clients = {k: openai.OpenAI(base_url=u, api_key=key, max_retries=0) for k, (u, key, _) in targets.items()}
    for _ in range(args.warmup):
        for c in clients.values():
            sync_call(c)

    async def burst(name: str) -> tuple[float, float]:
        """--calls calls at --concurrency at once: calls/s, and the proxy process's CPU per call (us)."""
        url, key, pid = targets[name]
        gate = asyncio.Semaphore(args.concurrency)
        async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
            async def one() -> None:
                async with gate:
                    r = await client.chat.completions.create(model="policy", messages=MESSAGES,
                                                             max_tokens=args.max_tokens, temperature=1.0)
                    assert r.choices[0].message is not None

            await asyncio.gather(*(one() for _ in range(args.concurrency)))  # warm: connections open
            c0, t0 = cpu_s(pid) if pid else 0.0, time.perf_counter()
            await asyncio.gather(*(one() for _ in range(args.calls)))
            dt = time.perf_counter() - t0
            return args.calls / dt, ((cpu_s(pid) - c0) / args.calls * 1e6) if pid else 0.0

    hop = {"ours": [], "litellm": []}
    cpu = {"ours": [], "litellm": []}
    cpu_hi = {"ours": [], "litellm": []}
    rate = {"direct": [], "ours": [], "litellm": []}
    names = list(targets)
    for run in range(args.runs):
        load0 = Path("/proc/loadavg").read_text().split()[0]
        walls: dict[str, list[float]] = {k: [] for k in names}
        used = {k: 0.0 for k in names}
        for k in range(args.calls):
            for name in names[k % 3:] + names[:k % 3]:
                pid = targets[name][2]
                c0 = cpu_s(pid) if pid else 0.0
                t0 = time.perf_counter()
                sync_call(clients[name])
                walls[name].append(time.perf_counter() - t0)
                used[name] += (cpu_s(pid) - c0) if pid else 0.0
        med = {k: statistics.median(v) * 1e3 for k, v in walls.items()}
        for name in ("ours", "litellm"):
            hop[name].append(med[name] - med["direct"])
            cpu[name].append(used[name] / args.calls * 1e6)
        order = names[run % 3:] + names[:run % 3]
        run_burst = {name: asyncio.run(burst(name)) for name in order}
        run_rate = {name: r for name, (r, _) in run_burst.items()}
        for name in names:
            rate[name].append(run_rate[name])
        for name in ("ours", "litellm"):
            cpu_hi[name].append(run_burst[name][1])
        load1 = Path("/proc/loadavg").read_text().split()[0]
        print(f"run {run + 1} (load average {load0} -> {load1}): one at a time, median ms per call: direct "
              f"{med['direct']:.2f}, ours {med['ours']:.2f} (cpu {cpu['ours'][-1]:.0f} us), litellm "
              f"{med['litellm']:.2f} (cpu {cpu['litellm'][-1]:.0f} us); at {args.concurrency}: direct "
              f"{run_rate['direct']:.1f} calls/s, ours {run_rate['ours']:.1f} (cpu {cpu_hi['ours'][-1]:.0f} us), litellm "
              f"{run_rate['litellm']:.1f} (cpu {cpu_hi['litellm'][-1]:.0f} us)",
              flush=True)

    ours_proc.stdin.close()
    recorded = int(ours_proc.stdout.readline() or 0)
    ours_proc.wait(timeout=30)
    theirs_proc.terminate()
    theirs_proc.wait(timeout=30)

print(f"\nmedian [min, max] over {args.runs} runs; {args.calls} calls each way per part; max_tokens {args.max_tokens}")
print("| | direct | ours (recording) | LiteLLM proxy |\n| --- | --- | --- | --- |")
print(f"| hop at 1 concurrent, ms (median per call - direct's) | - | {spread(hop['ours'])} | {spread(hop['litellm'])} |")
print(f"| proxy process CPU per call at 1, us | - | {spread(cpu['ours'], '.0f')} | {spread(cpu['litellm'], '.0f')} |")
print(f"| calls/s at {args.concurrency} concurrent | {spread(rate['direct'], '.1f')} | {spread(rate['ours'], '.1f')} | "
      f"{spread(rate['litellm'], '.1f')} |")
ratio = {k: [r / d for r, d in zip(rate[k], rate["direct"])] for k in ("ours", "litellm")}
print(f"| proxy process CPU per call at {args.concurrency}, us | - | {spread(cpu_hi['ours'], '.0f')} | "
      f"{spread(cpu_hi['litellm'], '.0f')} |")
print(f"| ratio to direct at {args.concurrency} | 1 | {spread(ratio['ours'], '.3f')} | {spread(ratio['litellm'], '.3f')} |")
print(f"recorded by ours: {recorded} calls")
print(f"hop_ratio={statistics.median(hop['ours']) / statistics.median(hop['litellm']):.3f}  (our hop / LiteLLM's, "
      f"at 1 concurrent)")
print(f"throughput_ratio={statistics.median(rate['ours']) / statistics.median(rate['litellm']):.3f}  (our calls/s / "
      f"LiteLLM's, at {args.concurrency} concurrent)")
