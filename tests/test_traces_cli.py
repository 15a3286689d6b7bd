"""`lightning traces` as a person reads it: plain words, each reply once, the task with its expected answer, a folder
of runs accepted as the dashboard accepts it, a line when a filter matches nothing, and the run left untouched.
A real agent call through the run's gateway to the built-in server on 127.0.0.1, stored in a real SQLite store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from lightning_sdk import tracing
from lightning_sdk.store import Store

from .conftest import in_rollout

ROOT = Path(__file__).resolve().parents[1]
TASK = {"question": "What is 2 + 3?", "answer": "5"}


@pytest.fixture()
def runs(tmp_path, gateway_server):
    """A folder of runs, `runs/arith`, holding one finished rollout whose one LLM call names no component."""
    store = Store(tmp_path / "runs/arith/store.sqlite")
    tracing.install(store, gateway_url=gateway_server.base_url)
    gateway_server.capture.record_to(store)
    try:
        store.add_tasks([("t-1", TASK)])
        store.start_rollout("it0001-r0", task_id="t-1", group_id="g-1", iteration=1, phase="train", model="tiny")
        with in_rollout(gateway_server, "it0001-r0"):
            c = openai.OpenAI(base_url=gateway_server.base_url, api_key=gateway_server.api_key, max_retries=0)
            reply = c.chat.completions.create(model="m", messages=[{"role": "user", "content": TASK["question"]}],
                                              max_tokens=6).choices[0].message.content
        assert gateway_server.capture.flush()
        tracing.flush()
        store.finish_rollout("it0001-r0", status="succeeded", output=reply, reward=1.0)
    finally:
        gateway_server.capture.record_to(None)
        store.close()
    return tmp_path / "runs", reply


def traces(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}  # a wide table: no id cut short
    return subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "traces", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_one_rollout_in_plain_words(runs):
    folder, reply = runs
    out = traces("--run-dir", str(folder), "--rollout", "it0001-r0")  # a folder of runs, as the dashboard takes
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "[-]" not in text and "UNSET" not in text
    assert "no component" in text
    assert "question: What is 2 + 3?" in text and "answer: 5" in text  # the task, expected answer included
    assert text.count(f"→ reply: {reply}") == 1 and json.dumps(reply) not in text  # once, not also quoted above


def test_a_filter_that_matches_nothing_says_so(runs):
    folder, _ = runs
    out = traces("--run-dir", str(folder), "--status", "failed")
    assert out.returncode == 0, out.stderr
    assert "no rollouts with status failed" in out.stdout
    listed = traces("--run-dir", str(folder))
    assert listed.returncode == 0 and "it0001-r0" in listed.stdout and "succeeded" in listed.stdout


def test_traces_never_writes_to_the_run(runs):
    folder, _ = runs
    db = folder / "arith/store.sqlite"
    before = (db.read_bytes(), db.stat().st_mtime_ns)
    for args in (("--run-dir", str(folder)), ("--run-dir", str(folder / "arith"), "--rollout", "it0001-r0")):
        assert traces(*args).returncode == 0
    assert (db.read_bytes(), db.stat().st_mtime_ns) == before
