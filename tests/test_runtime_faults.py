"""Faults injected for real into an in-process `Runtime` on the tiny model: agents that raise, hang or return
nothing, rewards that are not numbers, rows without the field the agent reads, and an inference server killed
with SIGKILL mid-collection (restarted, its rollouts re-run once) or killed for good (the run ends, log shown).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from lightning_sdk import config
from lightning_sdk.runtime import RunError, Runtime
from lightning_sdk.store import Store

AGENT = '''
import asyncio, threading
from openai import AsyncOpenAI
import lightning_sdk as ls

FOREVER = threading.Event()

async def ask(task, llm):
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        text = ""
        for _ in range(CALLS):
            out = await client.chat.completions.create(model=llm.model, max_tokens=4,
                messages=[{"role": "user", "content": task["question"]}])
            text = out.choices[0].message.content or ""
            await asyncio.sleep(PAUSE)
    return text

@ls.rollout
def solve(task, llm):
    fault = task.get("fault")
    text = asyncio.run(ask(task, llm))  # a sync agent: it runs in a thread of its own
    if fault == "raise":
        raise RuntimeError("agent blew up on " + task["question"])
    if fault == "hang":
        FOREVER.wait()
    if fault == "none":
        return None
    return text

@ls.reward
def score(task, output):
    fault = task.get("fault")
    if fault == "nan":
        return float("nan")
    if fault == "string":
        return "1.0"
    if output is None:
        return 0.0  # the documented rule: None is scored like any output
    return float(output.strip() == task["answer"])
'''


def make_project(tmp_path: Path, rows: list[dict], *, calls: int = 1, pause: float = 0.0, **sections: str) -> config.Config:
    (tmp_path / "agent.py").write_text(AGENT.replace("CALLS", str(calls)).replace("PAUSE", str(pause)))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tables = {"run": 'name = "faults"\ndir = "run"\niterations = 2', "agent": 'module = "agent.py"',
              "data": "train = \"train.jsonl\"\ntasks_per_iteration = 4\ngroup_size = 4\nshuffle = false",
              "model": 'dtype = "float32"', "rollout": "concurrency = 16\ntimeout = 5.0",
              "train": "lora_r = 4\nmicro_batch_size = 16"}
    tables.update(sections)
    (tmp_path / "lightning.toml").write_text("".join(f"[{k}]\n{v}\n" for k, v in tables.items()))
    return config.load(tmp_path / "lightning.toml")


def task(a: int, b: int, fault: str | None = None) -> dict:
    row = {"question": f"What is {a} + {b}?", "answer": str(a + b)}
    return {**row, "fault": fault} if fault else row


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_agent_and_reward_faults_are_failed_rollouts_and_the_run_goes_on(tmp_path):
    rows = [task(1, 2, "raise"), task(2, 2), task(3, 2, "nan"), task(4, 2), task(1, 3, "hang"), task(2, 3, "none"),
            task(3, 3, "string"), task(4, 3)]
    cfg = make_project(tmp_path, rows, run='name = "faults"\ndir = "run"\niterations = 1',
                       data='train = "train.jsonl"\ntasks_per_iteration = 8\ngroup_size = 2\nshuffle = false',
                       rollout="concurrency = 16\ntimeout = 6.0")
    t0 = time.perf_counter()
    state = Runtime(cfg, console=Console(file=io.StringIO())).run()
    print(f"faulty run: {time.perf_counter() - t0:.1f}s")
    assert state.completed == 1

    run = tmp_path / "run"
    (m,) = metrics(run)
    assert m["failed"] == 8 and m["rollouts"] == 16
    assert m["transitions"] == 8  # failed rollouts are left out of training; the rest of the batch is trained

    store = Store(run / "store.sqlite")
    by_fault: dict[str | None, set[str]] = {}
    for r in store.rollouts(phase="train"):
        fault = store.task(r.task_id).get("fault")
        by_fault.setdefault(fault, set()).add(r.status)
        if r.status == "failed":
            assert r.error and r.traceback and r.reward is None
    assert by_fault == {None: {"succeeded"}, "none": {"succeeded"}, "raise": {"failed"}, "nan": {"failed"},
                        "hang": {"failed"}, "string": {"failed"}}
    errors = {store.task(r.task_id).get("fault"): r.error for r in store.rollouts(status="failed")}
    assert "agent blew up" in errors["raise"] and "rollout.timeout=6.0" in errors["hang"]
    assert "nan" in errors["nan"] and "'1.0' (str)" in errors["string"] and "finite float" in errors["string"]


def test_reward_error_with_stop_ends_the_run_naming_rollout_and_value(tmp_path):
    rows = [task(1, 2), task(2, 2, "nan"), task(3, 2), task(4, 2)]
    cfg = make_project(tmp_path, rows, rollout='on_reward_error = "stop"')
    with pytest.raises(RunError, match=r"on_reward_error = 'stop'.*returned nan \(float\) for rollout it0000-001-"):
        Runtime(cfg, console=Console(file=io.StringIO())).run()
    assert not (tmp_path / "run/checkpoints").exists() or not any((tmp_path / "run/checkpoints").iterdir())
    assert len(Store(tmp_path / "run/store.sqlite").rollouts(status="failed")) == 4  # recorded before stopping


def test_rows_without_the_field_the_agent_reads_stop_the_run_naming_task_and_field(tmp_path):
    rows = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(4)]
    cfg = make_project(tmp_path, rows)
    with pytest.raises(RunError, match=r"16 of 16 rollouts failed.*KeyError: 'question' \(task \w+ has no field "
                                       r"'question'; its fields: 'prompt', 'answer'"):
        Runtime(cfg, console=Console(file=io.StringIO())).run()
