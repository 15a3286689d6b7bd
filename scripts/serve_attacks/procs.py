"""Issue 52 items 9 and 10, measured against whichever checkout is on PYTHONPATH (before and after):

9: aborted uploads on the chat and feedback routes (tracebacks in the serve log), a 401-digit feedback value (the
   answer), a run's isolated gateway killed (asyncio shutdown tracebacks), a forwarded replica line ("gateway:"
   twice);
10: a `run.runtime = "processes"` run killed with -9 (its workers alive after), one worker killed (said and
    replaced?), the gateway process stopped (named, or blamed on rollout timeouts), 20,000 bogus results under random
    worker names (names the dispatcher remembers), store_text = false (user text left in the records).

Every wait is bounded; the whole file runs in about 3 minutes on 2 loaded cores.
Run: PYTHONPATH=<checkout> python scripts/serve_attacks/procs.py
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

RUN_TOML = ('[run]\nname = "procs"\ndir = "run"\niterations = 1\n{runtime}[agent]\nmodule = "agent.py"\n'
            '[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 1\ngroup_size = {n}\n'
            '[model]\ndtype = "float32"\n[rollout]\nconcurrency = {n}\ntimeout = {timeout}\n[train]\nlora_r = 4\n')

GATEWAY_AGENT = '''
import os, signal, threading, time
from openai import OpenAI
import lightning_sdk as ls

once = threading.Lock()

def gateway_child():
    for line in os.popen(f"ps -o pid=,args= --ppid {{os.getpid()}}").read().splitlines():
        if "lightning_sdk.gateway.isolated" in line:
            return int(line.split()[0])

@ls.rollout
def solve(task, llm):
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=20)
    if once.acquire(blocking=False):
        os.kill(gateway_child(), signal.SIG{sig})
    time.sleep(1)
    client.chat.completions.create(model=llm.model, max_tokens=2, messages=[{{"role": "user", "content": "hi"}}])
    return "done"

@ls.reward
def score(task, output):
    return 1.0
'''

SLOW_AGENT = '''
import time
import lightning_sdk as ls

@ls.rollout
def solve(task, llm):
    time.sleep(120)
    return "late"

@ls.reward
def score(task, output):
    return 1.0
'''


def project(folder: Path, agent: str, *, n: int, timeout: float, runtime: str = "") -> None:
    (folder / "agent.py").write_text(agent)
    (folder / "train.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    (folder / "lightning.toml").write_text(RUN_TOML.format(runtime=runtime, n=n, timeout=timeout))


def start_run(folder: Path) -> tuple[subprocess.Popen, Path]:
    log = folder / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run", "-c", "lightning.toml"], cwd=folder,
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"})
    return proc, log


def finish(proc: subprocess.Popen, limit_s: float) -> bool:
    try:
        proc.wait(limit_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def abort_upload(url: str, key: str, path: str) -> None:
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: 1000\r\n\r\n{{\"value\": ".encode())


def serve_figures() -> None:
    """9 (aborted uploads, a 401-digit value, the replica line) and 10 (store_text) on one serve."""
    with serving.serve("", "--no-store-text") as s:
        root = s.url.rsplit("/v1", 1)[0]
        before = len(s.log_text())
        for k in range(100):
            abort_upload(root, s.key, "/v1/chat/completions" if k % 2 else "/v1/feedback")
        time.sleep(2)
        grown = s.log_text()[before:]
        serving.emit(9, "100 aborted uploads (chat + feedback): tracebacks in the serve log, bytes logged",
                     f"{grown.count('Traceback')} tracebacks, {len(grown.encode())} B")
        codes = []
        for field in ("value", "timestamp"):
            body = {"response_id": "chatcmpl-x", "value": 1.0, field: 10 ** 400}
            r = httpx.post(f"{s.url}/feedback", content=json.dumps(body), headers=s.headers, timeout=30)
            try:
                named = r.json().get("error", {}).get("param")
            except ValueError:  # a 500's plain-text body
                named = f"(not JSON: {r.text[:30]!r})"
            codes.append(f"{field} {r.status_code} {named}")
        serving.emit(9, "feedback with a 401-digit value / timestamp: status, field named", "; ".join(codes))

        ask = [{"role": "user", "content": "SECRET-TEXT"}]
        for body in ({"model": "SECRET-MODEL", "stop": ["SECRET-STOP"], "messages": ask, "max_tokens": 2},
                     {"model": "SECRET-MODEL", "messages": ask, "max_tokens": 2, "tools": [
                         {"type": "function", "function": {"name": "SECRET-TOOL"}}],
                      "tool_choice": {"type": "function", "function": {"name": "SECRET-OTHER"}}}):
            httpx.post(f"{s.url}/chat/completions", json=body, headers=s.headers, timeout=60)
        text, deadline = "", time.monotonic() + 20
        while time.monotonic() < deadline:
            db = sqlite3.connect(s.directory / "serve.sqlite")
            rows = db.execute("SELECT name, status_message, attributes FROM spans WHERE source='gateway'").fetchall()
            db.close()
            if len(rows) >= 2:
                text = str(rows)
                break
            time.sleep(0.5)
        found = [w for w in ("SECRET-MODEL", "SECRET-STOP", "SECRET-TOOL", "SECRET-OTHER") if w in text]
        serving.emit(10, "store_text = false: user words left in 2 records (model name, stop, error message)",
                     f"{len(found)} of 4 {found}")

        # a forwarded replica line: an isolated gateway in front of this serve and a port nobody listens on
        from lightning_sdk.gateway.isolated import IsolatedGateway

        lines: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        logging.getLogger("lightning_sdk").addHandler(Keep())
        logging.getLogger("lightning_sdk").setLevel(logging.INFO)
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        dead.close()
        g = IsolatedGateway(api_key="agents")
        try:
            g.start([root, f"http://127.0.0.1:{port}"], backend_key=s.key)
            g.policy = "builtin:tiny-arith"  # the serve in front of which it stands takes any model name
            for _ in range(3):
                httpx.post(f"{g.base_url}/chat/completions", headers={"Authorization": "Bearer agents"}, timeout=60,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            deadline = time.monotonic() + 10
            while not any("refuses connections" in x for x in lines) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            g.stop()
        line = next((x for x in lines if "refuses connections" in x), "no line within 10 s")
        serving.emit(9, "a replica refusing connections, as the run's process says it", line[:60])


def gateway_figures() -> None:
    """9: the run's isolated gateway killed; 10: stopped (SIGSTOP)."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        project(folder, GATEWAY_AGENT.format(sig="KILL"), n=6, timeout=60.0)
        proc, log = start_run(folder)
        ended = finish(proc, 120)
        text = log.read_text(errors="replace")
        said = "gateway's process ended" in text
        serving.emit(9, "the run's gateway process killed: its line said; shutdown tracebacks; Traceback lines",
                     f"said={said}; {text.count('unhandled exception during asyncio.run() shutdown')} shutdown "
                     f"tracebacks; {text.count('Traceback')} tracebacks"
                     + ("" if ended else "; still running at 120 s"))
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        project(folder, GATEWAY_AGENT.format(sig="STOP"), n=2, timeout=5.0)
        proc, log = start_run(folder)
        ended = finish(proc, 120)
        last = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:] or [""]
        serving.emit(10, "the run's gateway process stopped (SIGSTOP): the run's last line",
                     last[0][:110] + ("" if ended else " (still running at 120 s)"))


def workers_of(pid: int) -> list[int]:
    out = os.popen(f"ps -o pid=,args= --ppid {pid}").read().splitlines()
    return [int(x.split()[0]) for x in out if " worker " in x and "<defunct>" not in x]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def worker_figures() -> None:
    """10: a processes run: one worker killed (said, replaced?), then the run killed with -9 (workers left?)."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        project(folder, SLOW_AGENT, n=3, timeout=200.0, runtime='runtime = "processes"\n')
        proc, log = start_run(folder)
        known: set[int] = set()
        try:
            deadline = time.monotonic() + 120
            while len(workers_of(proc.pid)) < 3 and time.monotonic() < deadline:
                time.sleep(0.3)
            wlog = folder / "run" / "workers.log"
            while time.monotonic() < deadline and (not wlog.exists() or wlog.read_text().count("at a time") < 3):
                time.sleep(0.3)
            workers = workers_of(proc.pid)
            known |= set(workers)
            victim = workers[0]
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 15
            said = replaced = False
            while time.monotonic() < deadline and not (said and replaced):
                said = f"rollout worker {victim} ended" in log.read_text(errors="replace")
                now = set(workers_of(proc.pid))
                known |= now
                replaced = len(now - set(workers)) > 0
                time.sleep(0.3)
            serving.emit(10, "a processes run's worker killed: said / replaced within 15 s", f"{said} / {replaced}")
            proc.kill()
            proc.wait()
            time.sleep(10)
            left = [p for p in known if alive(p)]
            serving.emit(10, "a processes run killed with -9: its workers alive 10 s later",
                         f"{len(left)} of {len(known - {victim})}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for p in known:
                if alive(p):
                    os.kill(p, signal.SIGKILL)


def dispatcher_figure() -> None:
    import tracemalloc

    from lightning_sdk.rollouts.remote.dispatch import Dispatch
    from lightning_sdk.rollouts.remote.protocol import Result
    from lightning_sdk.store import Store

    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d) / "store.sqlite")
        dispatch = Dispatch(store)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for k in range(20_000):
            dispatch.finish(f"nobody-{k}", Result(worker=f"w-{secrets.token_hex(16)}", status="succeeded", reward=1.0),
                            secret=None)
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        store.close()
    serving.emit(10, "20,000 bogus results under random worker names: names remembered, memory kept (traced)",
                 f"{len(dispatch.seen)} names, {grown / 2**20:.1f} MiB")


if __name__ == "__main__":
    dispatcher_figure()
    serve_figures()
    gateway_figures()
    worker_figures()
