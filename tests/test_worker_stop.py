"""`lightning worker` stops cleanly: Ctrl-C (SIGINT) or SIGTERM stops its claims, lets the rollouts in flight finish
and be reported, and exits 130 / 143, also when a script started it in the background (SIGINT inherited ignored);
a second signal stops it at once and names the rollouts the server will re-run. A real worker process against
tests/remote_harness.py's Api (gateway, CPU server, SQLite) on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import sys
from pathlib import Path

from lightning_sdk.store import Store

from .remote_harness import KEY, Api, job
from .test_remote_worker import AGENT, ROOT, until


def worker(api: Api, cwd: Path, *, block: bool = False) -> subprocess.Popen:
    """A worker started as `lightning worker ... &` from a script starts: SIGINT ignored."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_TOKEN": KEY, "COLUMNS": "200",
           "REMOTE_AGENT_BLOCK": "1" if block else "0"}
    env.pop("OPENAI_BASE_URL", None)
    return subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "worker", AGENT, "--server", api.url,
                             "--concurrency", "2"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def test_ctrl_c_in_the_background_drains_the_rollouts_in_flight(server, tmp_path):
    api = Api(server, Store(tmp_path / "server.sqlite"))
    api.queue([job(k, {"question": f"What is {k} + 1?", "answer": str(k + 1), "sleep": 3.0}) for k in range(2)])
    w = worker(api, tmp_path)
    try:
        until(lambda: api.store.count("spans") >= 2, 60, "both rollouts' LLM calls")  # both now sleep 3 s
        w.send_signal(signal.SIGINT)
        out, _ = w.communicate(timeout=60)
        results = api.results(2, timeout=10)  # reported before it exited
    finally:
        w.kill()
        api.stop()
    assert w.returncode == 130, out
    assert sorted(r.job.rollout_id for r in results) == ["r-0", "r-1"] and {r.status for r in results} == {"succeeded"}
    assert "worker stopped (Ctrl-C)" in out and "2 succeeded" in out and "nothing for the server to re-run" in out


def test_sigterm_twice_stops_at_once_and_names_what_the_server_re_runs(server, tmp_path):
    api = Api(server, Store(tmp_path / "server.sqlite"))
    api.queue([job(0, {"question": "What is 1 + 1?", "answer": "2", "block": True}, prefix="hang")])
    w = worker(api, tmp_path, block=True)
    try:
        until(lambda: api.store.count("spans") >= 1, 60, "the rollout's LLM call")  # it now hangs
        w.send_signal(signal.SIGTERM)  # first: finish what runs (it never will)
        time.sleep(1.0)
        w.send_signal(signal.SIGTERM)
        out, _ = w.communicate(timeout=30)
    finally:
        w.kill()
        api.stop()
    assert w.returncode == 143, out
    assert "worker stopped (SIGTERM)" in out and "the server re-runs hang-0 after its deadline" in out
