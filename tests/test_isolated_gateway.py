"""The gateway served from a process of its own (gateway/isolated.py), as a run whose agents run in its process
serves it: calls relayed and recorded there, written to this process's store in order with its flushes; routing,
rollouts and counts commanded from here; a child that dies is said at once, and a run killed with -9 leaves no
gateway behind."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from openai import OpenAI

from lightning_sdk import compat
from lightning_sdk.errors import RunError
from lightning_sdk.gateway.isolated import IsolatedGateway, PairedRollouts
from lightning_sdk.store import Store
from lightning_sdk.tracing import COMPLETION_IDS, PROMPT_IDS, is_llm_call
from tests.conftest import SERVED
from tests.test_group_baseline import run_one_task

ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture()
def apart(server):
    g = IsolatedGateway(api_key="agents")
    g.start([server.url], backend_key=server.api_key, grammar=server.grammar)
    g.policy = SERVED
    yield g
    g.stop()


def ask(gateway, trace_id: str, model: str = "gpt-4o-mini", **headers) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/chat/completions", timeout=60,
                      headers={"Authorization": "Bearer agents", "traceparent": f"00-{trace_id}-{'cd' * 8}-01",
                               **headers},
                      json={"model": model, "messages": ASK, "max_tokens": 3})


def test_calls_are_served_from_another_process_and_recorded_here_before_flush_returns(apart, tmp_path):
    assert apart.pid != os.getpid() and psutil.pid_exists(apart.pid)
    port = int(apart.url.rsplit(":", 1)[1])
    assert all(c.laddr.port != port for c in psutil.Process().net_connections("tcp"))  # it listens, not we
    store = Store(tmp_path / "store.sqlite")
    apart.capture.record_to(store)
    keys = [f"{k:032x}" for k in range(1, 9)]
    for k, key in enumerate(keys):
        apart.rollouts.open(key, f"r-{k}")
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda key: ask(apart, key), keys * 3))
    assert [r.status_code for r in replies] == [200] * 24
    assert all(r.json()["model"] == SERVED and r.headers["x-lightning-call-id"] for r in replies)
    assert apart.capture.flush()  # every record written here when it returns: nothing polled for
    for k in range(8):
        calls = [s for s in store.spans(f"r-{k}") if is_llm_call(s)]
        assert len(calls) == 3 and all(c.attributes[PROMPT_IDS] and c.attributes[COMPLETION_IDS] for c in calls)
        assert {c.span_id for c in calls} <= {r.headers["x-lightning-call-id"] for r in replies}
    assert apart.capture.recorded == 24 and apart.capture.unattributed == 0 and apart.capture.errors == []
    apart.rollouts.close(keys[0])
    assert ask(apart, keys[0]).status_code == 200  # served, of no rollout now
    assert apart.capture.flush() and apart.capture.unattributed == 1
    assert apart.asked == {"gpt-4o-mini": 25}
    assert apart.backends.urls and sum(apart.backends.served) == 25
    apart.capture.record_to(None)
    store.close()


def test_routing_names_and_log_lines_come_from_the_child(apart, server, caplog):
    client = OpenAI(base_url=apart.base_url, api_key="agents", max_retries=0)
    with caplog.at_level(logging.INFO, logger="lightning_sdk"):
        assert client.chat.completions.create(model="mine", messages=ASK, max_tokens=2).model == SERVED
        deadline = time.monotonic() + 10
        while not any("asked for model 'mine'" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
    apart.route(None, {})
    with pytest.raises(Exception) as e:
        client.chat.completions.create(model="mine", messages=ASK, max_tokens=2)
    assert "no policy is being served" in str(e.value)
    apart.route(SERVED, {"solver": SERVED})
    assert apart.policy == SERVED and apart.by_component == {"solver": SERVED}
    client.chat.completions.create(model="mine", messages=ASK, max_tokens=2)  # no component: by the policy
    assert apart.base_served == {"": 1}


def test_a_command_the_child_fails_is_a_run_error_naming_it(apart):
    with pytest.raises(RunError, match="failed 'route'"):
        apart.call("route", ("too few",))
    apart.policy = SERVED  # the pair is still in step
    assert apart.asked == {}


def test_a_lookup_takes_in_openings_its_reader_has_not_reached():
    """The child's lookup of a call's rollout, with no thread reading the pair: what the run sent is taken in first,
    in order (an opening, then its closing)."""
    ours, theirs = socket.socketpair()
    run, child = compat.connection(ours.detach()), compat.connection(theirs.detach())
    rollouts = PairedRollouts(child)
    run.send(("open", ("ab" * 16, "r-1", 2, "eval", 7, None)))
    found = rollouts.get("ab" * 16)
    assert (found.rollout_id, found.attempt, found.phase, found.seed) == ("r-1", 2, "eval", 7)
    run.send(("close", "ab" * 16))
    run.send(("open", ("cd" * 16, "r-2", 1, "train", None, "s3cret")))
    assert rollouts.get("cd" * 16).secret == "s3cret" and rollouts.get("ab" * 16) is None
    assert rollouts.get(None) is None and not rollouts.ended
    run.close()
    assert rollouts.get("ef" * 16) is None and rollouts.ended  # the run's end closed: nothing more to take in
    child.close()


def test_each_rollout_is_open_for_its_first_call_though_its_opening_is_not_answered(apart, tmp_path):
    """An opening is sent, never waited for: the child takes in what has arrived before it decides a call is of
    no rollout. 300 rollouts, each called the moment it is opened, from threads that race the child's reader."""
    store = Store(tmp_path / "store.sqlite")
    apart.capture.record_to(store)
    keys = [f"{k + 1:032x}" for k in range(300)]

    def open_and_call(k: int) -> int:
        apart.rollouts.open(keys[k], f"r-{k}")
        return ask(apart, keys[k]).status_code

    with ThreadPoolExecutor(6) as pool:
        assert set(pool.map(open_and_call, range(300))) == {200}
    assert apart.capture.flush() and apart.capture.unattributed == 0 and apart.capture.recorded == 300
    assert all(len([s for s in store.spans(f"r-{k}") if is_llm_call(s)]) == 1 for k in range(0, 300, 7))
    apart.capture.record_to(None)
    store.close()


def test_the_key_is_not_on_the_childs_command_line(server):
    g = IsolatedGateway(api_key="a-secret-key-0123")
    try:
        assert "a-secret-key-0123" not in " ".join(psutil.Process(g.pid).cmdline())
    finally:
        g.stop()
    assert not psutil.pid_exists(g.pid) or psutil.Process(g.pid).status() == psutil.STATUS_ZOMBIE


def test_a_child_killed_is_said_at_once_and_its_callers_are_refused(server):
    g = IsolatedGateway(api_key="agents")
    g.start([server.url], backend_key=server.api_key, grammar=server.grammar)
    g.policy = SERVED
    os.kill(g.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while g.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RunError, match=r"gateway's process ended \(exit code -9\)"):
        g.rollouts.open("ab" * 16, "r")
    assert g.capture.flush() is False  # what it had made and not sent is lost: never said to be written
    with pytest.raises(httpx.ConnectError):  # refused, not left waiting in a backlog nobody accepts from
        httpx.post(f"{g.base_url}/chat/completions", json={}, timeout=5)
    g.stop()


RUN_AND_DIE = """
import sys, time
from lightning_sdk.gateway.isolated import IsolatedGateway, PairedRollouts
g = IsolatedGateway(api_key="agents")
print(g.pid, flush=True)
time.sleep(600)
"""


def test_a_run_killed_with_minus_9_leaves_no_gateway_behind():
    run = subprocess.Popen([sys.executable, "-c", RUN_AND_DIE], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
    child = int(run.stdout.readline())
    assert psutil.Process(child).ppid() == run.pid
    run.kill()
    run.wait()
    deadline = time.monotonic() + 15
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the gateway outlived its run"
        time.sleep(0.05)


AGENT = '''
import os
from urllib.parse import urlsplit
import psutil
from openai import OpenAI
import lightning_sdk as ls

@ls.rollout
def solve(task, llm):
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(model=llm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    port = urlsplit(llm.base_url).port
    mine = any(c.laddr.port == port and c.status == "LISTEN" for c in psutil.Process().net_connections("tcp"))
    return "here" if mine else "apart"

@ls.reward
def score(task, output):
    return float(output == "apart")
'''


def test_an_in_process_run_calls_a_gateway_served_from_another_process(tmp_path):
    run_one_task(tmp_path, AGENT, group_size=2, concurrency=2)
    store = Store(tmp_path / "run/store.sqlite")
    rollouts = store.rollouts(phase="train")
    assert [r.output for r in rollouts] == ["apart", "apart"], rollouts
    assert all(len([s for s in store.spans(r.rollout_id) if is_llm_call(s)]) == 1 for r in rollouts)
    assert not [p for p in psutil.Process().children(recursive=True)
                if "lightning_sdk.gateway.isolated" in " ".join(p.cmdline())]  # stopped with the run
