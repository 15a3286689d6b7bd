"""`lightning worker` processes against a real Lightning server on 127.0.0.1 (gateway, CPU server, SQLite), and the
faults of issue 15 item 4: the server restarting under a worker, a worker killed mid-rollout (abandoned at its
deadline, spans kept, re-run once under a new id, its late result refused), no worker at all."""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from lightning_sdk import config
from lightning_sdk.errors import RunError
from lightning_sdk.rollouts.remote.collect import RemoteCollector
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.servers.process import new_api_key
from lightning_sdk.store import Store
from lightning_sdk.transitions import to_transitions

from .remote_harness import KEY, Api, job

HERE = Path(__file__).parent
ROOT = HERE.parent
AGENT = str(HERE / "remote_agent.py")


def start_worker(*args: str, token: str, cwd: Path, block: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_TOKEN": token, "COLUMNS": "200",
           "REMOTE_AGENT_BLOCK": "1" if block else "0"}
    env.pop("OPENAI_BASE_URL", None)
    return subprocess.Popen([sys.executable, str(HERE / "remote_worker_probe.py"), "worker", *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def until(check, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_worker_runs_rollouts_and_rides_out_a_server_restart(server, tmp_path):
    api = Api(server, Store(tmp_path / "server.sqlite"))
    tasks = [{"question": f"What is {k} + 1?", "answer": str(k + 1), "sleep": 0.5} for k in range(4)]
    api.queue([job(k, t) for k, t in enumerate(tasks)])
    worker = start_worker(AGENT, "--server", api.url, "--concurrency", "2", token=KEY, cwd=tmp_path)
    try:
        until(lambda: api.store.count("spans") >= 2, 60, "two rollouts' LLM calls")  # shipped as they end
        api.restart(down_s=2.0)  # results and the next claims come while nothing listens: retried
        results = api.results(4)
        worker.send_signal(signal.SIGINT)  # Ctrl-C while it waits for work
        out, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
        api.stop()
    assert worker.returncode == 130, out
    assert "unreachable" in out and "reachable again" in out and "worker stopped (Ctrl-C)" in out
    assert "IMPORTED []" in out  # no torch, transformers, peft, fastapi, uvicorn, store or serving code
    assert sorted(r.job.rollout_id for r in results) == ["r-0", "r-1", "r-2", "r-3"]
    assert all(r.status == "succeeded" and r.output["base_url"] == f"{api.url}/v1" for r in results)
    for r in results:
        [t] = to_transitions(api.store.rollout(r.job.rollout_id), api.store.spans(r.job.rollout_id))
        assert t.prompt_ids and len(t.logprobs) == len(t.completion_ids)
    assert api.dispatch.spans_refused == {}


def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from lightning_sdk.cli import main

    monkeypatch.chdir(tmp_path)
    for var in ("LIGHTNING_SERVER", "LIGHTNING_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    for args, env, words in ((["worker", AGENT], {}, "no server"),
                             (["worker", AGENT, "--server", "http://127.0.0.1:9"], {}, "no token"),
                             (["worker", "--server", "ftp://x"], {"LIGHTNING_TOKEN": "t"}, "expected an http"),
                             (["worker", "nope.py", "--server", "http://127.0.0.1:9"], {"LIGHTNING_TOKEN": "t"},
                              "'nope.py': file not found"),
                             (["worker", "--server", "http://127.0.0.1:9"], {"LIGHTNING_TOKEN": "t"},
                              "no agent module"),
                             (["worker", "--run-dir", str(tmp_path)], {}, "no readable server.json")):
        result = CliRunner().invoke(main, args, env=env)
        assert result.exit_code == 2 and words in result.output, (args, result.output)
        assert result.output.count("\n") == 1


@pytest.fixture(scope="module")
def remote(tiny_model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("remote")
    cfg = config.parse({"run": {"runtime": "remote", "dir": str(d)}, "data": {"train": str(d / "t.jsonl")},
                        "rollout": {"timeout": 2.0}, "remote": {"grace": 1.0, "worker_timeout": 1.0},
                        "serve": {"max_batch_size": 8}})
    gateway = Gateway(api_key=new_api_key())
    store = Store(d / "store.sqlite")
    collector = RemoteCollector(cfg, agent=None, gateway=gateway, model_path=tiny_model_path, store=store,
                                log_dir=d, console=Console(file=io.StringIO(), width=200))
    collector.start()
    gateway.policy = collector.server.served_model_name
    gateway.capture.record_to(store)  # as the runtime's session does
    yield collector
    collector.stop()
    gateway.stop()
    store.close()


def test_no_worker_stops_the_run_with_how_to_start_one(remote):
    token = remote.run_dir / "worker.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text().strip() == remote.worker_token
    assert json.loads((remote.run_dir / "server.json").read_text()) == {"url": remote.gateway.url}
    with pytest.raises(RunError) as e:
        remote.collect([job(0, {"question": "?"}, prefix="lonely")], remote.gateway.policy, label="lonely")
    message = str(e.value)
    assert "remote.worker_timeout" in message and remote.gateway.url in message and str(token) in message
    assert "lightning worker" in message
    assert remote.dispatch.counts() == (0, 0)  # the phase is closed: a late worker finds nothing of it


def test_a_killed_worker_s_rollout_is_abandoned_then_run_once_more(remote, tmp_path):
    remote.cfg.remote.worker_timeout = 60.0
    remote.cfg.rollout.timeout = 5.0  # the re-run's LLM call has time even on a loaded machine
    store = remote.store
    jobs = [job(0, {"question": "What is 1 + 1?", "answer": "2", "block": True}, prefix="kill")]
    out: dict = {}
    collecting = threading.Thread(target=lambda: out.update(results=remote.collect(jobs, remote.gateway.policy,
                                                                                   label="kill")))
    collecting.start()
    victim = start_worker(AGENT, "--run-dir", str(remote.run_dir), "--concurrency", "1", token="", cwd=tmp_path,
                          block=True)
    second = None
    try:
        until(lambda: store.spans("kill-0"), 60, "the first attempt's LLM call")  # it now hangs
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        second = start_worker(AGENT, "--run-dir", str(remote.run_dir), token="", cwd=tmp_path)
        collecting.join(60)
        assert not collecting.is_alive()
        # the dead worker's result, posted late by another process: refused, nothing changes
        late = subprocess.run([sys.executable, "-c", (
            "import httpx, sys; r = httpx.post(sys.argv[1] + '/v1/work/kill-0/result', headers={'Authorization': "
            "'Bearer ' + sys.argv[2]}, json={'worker': 'late', 'status': 'succeeded', 'reward': 1.0}); "
            "print(r.status_code)"), remote.gateway.url, remote.worker_token],
            capture_output=True, text=True, timeout=60)
        assert late.stdout.strip() == "409", late.stderr
    finally:
        for p in (victim, second):
            if p is not None:
                p.kill()
                p.wait(10)
    [result] = out["results"]
    assert result.job.rollout_id == "kill-0-r2" and result.job.attempt == 2 and result.status == "succeeded"
    first, rerun = store.rollout("kill-0"), store.rollout("kill-0-r2")
    assert first.status == "abandoned" and "re-run as kill-0-r2" in first.error and first.reward is None
    assert [s.rollout_id for s in store.spans("kill-0")] == ["kill-0"]  # the first attempt's call: kept
    assert rerun.status == "succeeded" and rerun.attempt == 2 and store.spans("kill-0-r2")
    assert [r.rollout_id for r in store.rollouts() if r.rollout_id.startswith("kill")] == ["kill-0", "kill-0-r2"]
    assert [r["kind"] for r in store.rewards("kill-0")] == [] and len(store.rewards("kill-0-r2")) == 1


def test_a_result_after_the_deadline_is_refused(remote):
    """A worker alive but slower than rollout.timeout + remote.grace: its claim is abandoned, its result 409."""
    remote.cfg.remote.worker_timeout = 60.0
    remote.cfg.rollout.timeout, remote.cfg.remote.grace = 1.0, 0.5
    url, auth = remote.gateway.url, {"Authorization": f"Bearer {remote.worker_token}"}
    jobs = [job(0, {"question": "?"}, prefix="slow")]
    out: dict = {}
    collecting = threading.Thread(target=lambda: out.update(results=remote.collect(jobs, remote.gateway.policy,
                                                                                   label="slow")))
    collecting.start()
    with httpx.Client(base_url=url, headers=auth, timeout=30) as http:
        claims = []
        for _ in range(2):  # the first attempt, then its re-run: both left to expire
            claim = http.post("/v1/work/claim", json={"worker": "slow"}).json()
            claims.append(claim)
            assert claim["timeout"] == 1.0 and 0 < claim["deadline_s"] <= 1.5
            until(lambda c=claim: remote.store.rollout(c["rollout_id"]).status == "abandoned", 30, "the deadline")
            r = http.post(f"/v1/work/{claim['rollout_id']}/result", headers={"x-lightning-claim": claim["secret"]},
                          json={"worker": "slow", "status": "succeeded", "reward": 1.0})
            assert r.status_code == 409
    collecting.join(30)
    assert [c["rollout_id"] for c in claims] == ["slow-0", "slow-0-r2"]
    [result] = out["results"]  # one result for one job: a failure of the infrastructure, never trained
    assert result.status == "failed" and result.failed_in is None and result.error.startswith("WorkerLost")
    assert [r.status for r in remote.store.rollouts() if r.rollout_id.startswith("slow")] == ["abandoned"] * 2
