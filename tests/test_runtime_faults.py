"""Faults injected for real into an in-process `Runtime` on the tiny model: agents that raise, hang or return
nothing, rewards that are not numbers, rows without the field the agent reads, and an inference server killed
with SIGKILL mid-collection (restarted, its rollouts re-run once) or killed for good (the run ends, log shown).
"""

from __future__ import annotations

import io
import json
import math
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
from lightning_sdk.errors import RunError
from lightning_sdk.runtime import Runtime
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


def make_project(tmp_path: Path, rows: list[dict], *, calls: int = 1, pause: float = 0.0,
                 **sections: str) -> config.Config:
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
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") != "eval"]  # the iteration rows


def test_agent_and_reward_faults_are_failed_rollouts_the_run_goes_on_until_most_fail(tmp_path):
    rows = [task(1, 2, "raise"), task(2, 2), task(3, 2, "nan"), task(4, 2), task(1, 3, "hang"), task(2, 3, "none"),
            task(3, 3, "string"), task(4, 3)]  # iteration 1: half of the rollouts fail, in five different ways
    rows += [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)]  # iteration 2: all fail
    cfg = make_project(tmp_path, rows, run='name = "faults"\ndir = "run"\niterations = 2',
                       data='train = "train.jsonl"\ntasks_per_iteration = 8\ngroup_size = 2\nshuffle = false',
                       rollout="concurrency = 16\ntimeout = 20.0")  # generous: a loaded CI machine
    out = io.StringIO()
    with pytest.raises(RunError) as stopped:
        Runtime(cfg, console=Console(file=out, width=300)).run()
    # One line: the 16 near-identical messages (they differ in the task id) counted once, where the agent raised.
    line = next(i for i, x in enumerate(AGENT.splitlines(), 1) if 'task["question"]}])' in x)
    assert str(stopped.value).startswith(
        "iteration 2: 16 of 16 rollouts failed (16 x KeyError: 'question' (task <id> has no field 'question'; its "
        f"fields: 'prompt', 'answer'."), str(stopped.value)
    assert f"(agent.py:{line} in ask)); not training on the rest." in str(stopped.value)
    assert "[" not in str(stopped.value) and "\n" not in str(stopped.value) and len(str(stopped.value)) < 600
    # Iteration 1's line says how many failed, and why, grouped the same way.
    (it1,) = [x for x in out.getvalue().splitlines() if x.startswith("iteration 1:")]
    assert "(8 rollouts, 8 of 16 failed: 2 x " in it1, it1
    assert "more of 2 other kind(s)" in it1

    run = tmp_path / "run"
    assert (run / "checkpoints/iter-00001").exists() and not (run / "checkpoints/iter-00002").exists()
    (m,) = metrics(run)
    assert m["rollout/failed"] == 8 and m["rollout/rollouts"] == 16
    assert m["rollout/transitions"] == 8  # failed rollouts are left out of training; the rest of the batch is trained

    store = Store(run / "store.sqlite")
    by_fault: dict[str | None, set[str]] = {}
    for r in store.rollouts(phase="train", iteration=1):
        fault = store.task(r.task_id).get("fault")
        by_fault.setdefault(fault, set()).add(r.status)
        if r.status == "failed":
            assert r.error and r.traceback and r.reward is None
    assert by_fault == {None: {"succeeded"}, "none": {"succeeded"}, "raise": {"failed"}, "nan": {"failed"},
                        "hang": {"failed"}, "string": {"failed"}}
    errors = {store.task(r.task_id).get("fault"): r.error for r in store.rollouts(status="failed", iteration=1)}
    assert "agent blew up" in errors["raise"] and "rollout.timeout=20.0" in errors["hang"]
    assert "nan" in errors["nan"] and "'1.0' (str)" in errors["string"] and "finite float" in errors["string"]


def test_reward_error_with_stop_ends_the_run_naming_rollout_and_value(tmp_path):
    rows = [task(1, 2), task(2, 2, "nan"), task(3, 2), task(4, 2)]
    cfg = make_project(tmp_path, rows, rollout='on_reward_error = "stop"')
    with pytest.raises(RunError, match=r"on_reward_error = 'stop'.*returned nan \(float\) for rollout it0001-001-"):
        Runtime(cfg, console=Console(file=io.StringIO())).run()
    assert not (tmp_path / "run/checkpoints").exists() or not any((tmp_path / "run/checkpoints").iterdir())
    assert len(Store(tmp_path / "run/store.sqlite").rollouts(status="failed")) == 4  # recorded before stopping


def _spans_of_iteration(db: Path, iteration: int) -> int:
    if not db.exists():
        return 0
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return c.execute("SELECT COUNT(*) FROM spans JOIN rollouts USING (rollout_id) WHERE rollouts.iteration = ? "
                         "AND rollouts.phase = 'train'", (iteration,)).fetchone()[0]
    except sqlite3.OperationalError:  # the schema is not there yet
        return 0
    finally:
        c.close()


def _wait(condition, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_server_killed_mid_collection_is_restarted_then_one_that_cannot_come_back_ends_the_run(tmp_path):
    rows = [task(a, 2) for a in range(1, 5)]
    cfg = make_project(tmp_path, rows, calls=3, pause=0.2, run='name = "faults"\ndir = "run"\niterations = 3',
                       data='train = "train.jsonl"\ntasks_per_iteration = 2\ngroup_size = 4\nshuffle = false',
                       rollout="concurrency = 8\ntimeout = 120.0",
                       train="lora_r = 4\nmicro_batch_size = 4\nepochs = 4")  # an update long enough to kill in
    out = io.StringIO()
    rt = Runtime(cfg, console=Console(file=out, width=200))
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["state"] = rt.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = e

    db = tmp_path / "run/store.sqlite"
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    blocker = socket.socket()
    try:
        # Kill 1: SIGKILL the server while iteration 2 (policy = the iter-1 adapter) is collecting.
        _wait(lambda: _spans_of_iteration(db, 2) >= 2, "iteration 2 collection")
        first_pid = rt.collector.server._proc.pid
        os.kill(first_pid, signal.SIGKILL)

        # Kill 2, during that iteration's update: SIGKILL it again and take its port, so no restart can bind.
        _wait(lambda: _collected(db, 2, 8), "iteration 2 update")
        second_pid, port = rt.collector.server._proc.pid, rt.collector.server.port
        assert second_pid != first_pid
        os.kill(second_pid, signal.SIGKILL)
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _wait(lambda: _bind(blocker, port), "the dead server's port to be free", timeout=30)
        blocker.listen()
        thread.join(timeout=240)
        assert not thread.is_alive()
    finally:
        blocker.close()

    error = outcome.get("error")
    assert isinstance(error, RunError), outcome
    assert "did not come back" in str(error) and "address already in use" in str(error)  # the server log's tail
    assert (tmp_path / "run/checkpoints/iter-00002").exists()  # the update finished; the hot-load found it dead
    assert "the inference server died; restarting it" in out.getvalue()

    store = Store(db)
    it1 = store.rollouts(phase="train", iteration=2)
    retries = [r for r in it1 if r.attempt == 2]
    originals = {r.rollout_id: r for r in it1 if r.attempt == 1}
    assert retries, "no rollout was in flight when the server was killed"
    for r in retries:  # re-run once on the restarted server, which had the current adapter loaded again
        assert r.rollout_id.endswith("-r2") and r.status == "succeeded" and r.model == "faults-iter1"
        old = originals[r.rollout_id.removesuffix("-r2")]
        assert old.status == "abandoned" and f"re-run as {r.rollout_id}" in old.error
    assert all(r.status == "succeeded" for r in it1 if r.attempt == 1 and r.rollout_id + "-r2" not in
               {x.rollout_id for x in retries})
    assert store.rollouts(phase="train", iteration=3) == []  # noticed at the hot-load, before any new rollout
    (row,) = [r for r in json.loads((tmp_path / "run/checkpoints/iter-00002/state.json").read_text())["history"]
              if r["iteration"] == 2]
    assert row["rollout/rollouts"] == 8 and row["rollout/failed"] == 0
    print(f"server kill: {len(retries)} in-flight rollouts re-run after the restart, all succeeded")


def _collected(db: Path, iteration: int, n: int) -> bool:
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        done, running = c.execute("SELECT COUNT(*) FILTER (WHERE status = 'succeeded'), COUNT(*) FILTER (WHERE "
                                  "status = 'running') FROM rollouts WHERE iteration = ? AND phase = 'train'",
                                  (iteration,)).fetchone()
    finally:
        c.close()
    return done >= n and running == 0


def _bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------ span ids and a stored span

def test_span_ids_do_not_follow_pythons_random_state(tmp_path):
    """A resumed trainer once restored `random`'s state, and OpenTelemetry drew the same span ids again."""
    import random

    from lightning_sdk import tracing
    from lightning_sdk.tracing import instrument

    with Store(tmp_path / "store.sqlite") as store:
        tracing.install(store)
        tracer = instrument._state.provider.get_tracer("test")
        ids = []
        for _ in range(2):
            random.seed(1234)
            with tracer.start_as_current_span("call") as span:
                ids.append((span.get_span_context().span_id, span.get_span_context().trace_id))
        assert ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1]
        tracing.flush()


def test_the_store_keeps_the_first_span_under_an_id_and_counts_the_conflict(tmp_path):
    from lightning_sdk.tracing.records import SpanRecord

    def span(rollout: str, name: str) -> SpanRecord:
        return SpanRecord(span_id="00ab", trace_id="t", parent_id=None, rollout_id=rollout, attempt=1,
                          component=None, name=name, start_ns=1, end_ns=2, status="OK", status_message=None,
                          attributes={"k": rollout})

    with Store(tmp_path / "store.sqlite") as store:
        assert store.write_spans([span("r1", "chat")]) == []
        assert store.write_spans([span("r1", "chat")]) == [] and store.span_conflicts == 0  # the same span again
        assert store.write_spans([span("r2", "other")]) == ["00ab"]
        (kept,) = store.spans("r1")
        assert kept.name == "chat" and kept.attributes == {"k": "r1"} and store.spans("r2") == []
        assert store.span_conflicts == 1 and store.count("spans") == 1


# ------------------------------------------------------------------- agent faults that used to end the run

FAULTY_AGENT = '''
import asyncio, sys
import numpy as np
import torch
from openai import AsyncOpenAI
import lightning_sdk as ls

@ls.rollout
async def solve(task, llm):
    if task.get("touched"):
        raise RuntimeError("saw the task another rollout of its group had changed")
    task["touched"] = True  # an agent that edits its task: the rest of its group must not see it
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        out = await client.chat.completions.create(model=llm.model, max_tokens=4,
            messages=[{"role": "user", "content": task["question"]}])
    fault = task.get("fault")
    if fault == "exit":
        sys.exit(0)
    if fault == "exit-in-thread":
        await asyncio.to_thread(sys.exit, 0)
    if fault == "keyboard-interrupt":
        raise KeyboardInterrupt
    if fault == "cancelled":
        raise asyncio.CancelledError
    if fault == "self-referencing list":
        loop = [1]
        loop.append(loop)
        return loop
    if fault == "tuple keys":
        return {(1, 2): "a"}
    return out.choices[0].message.content or ""

@ls.reward
def score(task, output):
    if "touched" in task:
        return float("nan")  # the reward's task must be the dataset's, not what the agent made of it
    rewards = {"1e200": 1e200, "np.float32": np.float32(0.5), "np.int64": np.int64(1), "0-d tensor": torch.tensor(0.25),
               "np.bool_": np.bool_(True)}
    fault = task.get("fault")
    if fault == "reward-exit":
        sys.exit(0)  # a sync reward: in a thread of its own
    return rewards.get(fault, 0.0)
'''

FAULTS = {  # fault -> the rollouts' status and what their error or reward says
    "exit": ("failed", "raised SystemExit(0)"), "exit-in-thread": ("failed", "raised SystemExit(0)"),
    "keyboard-interrupt": ("failed", "raised KeyboardInterrupt()"), "cancelled": ("failed", "raised CancelledError()"),
    "reward-exit": ("failed", "raised SystemExit(0)"),
    "self-referencing list": ("succeeded", "[1, [...]]"), "tuple keys": ("succeeded", "{(1, 2): 'a'}"),
    "1e200": ("failed", "expected a reward within +-1e+06"), "np.float32": ("succeeded", 0.5), "np.int64": ("succeeded", 1.0),
    "0-d tensor": ("succeeded", 0.25), "np.bool_": ("succeeded", 1.0),
}


def test_agent_faults_fail_only_their_rollout_and_the_run_trains(tmp_path):
    """sys.exit, KeyboardInterrupt and CancelledError from the agent, outputs JSON cannot hold, a reward of 1e200
    (beyond the bound), numpy/torch scalar rewards, and an agent that edits its task: one iteration, trained, nothing left running."""
    rows = [task(i, 1, fault) for i, fault in enumerate(FAULTS)] + [task(i, 2) for i in range(6)]
    cfg = make_project(tmp_path, rows, run='name = "faults"\ndir = "run"\niterations = 1',
                       data=f'train = "train.jsonl"\ntasks_per_iteration = {len(rows)}\ngroup_size = 2\n'
                            f'shuffle = false', rollout="concurrency = 8\ntimeout = 60.0")
    (tmp_path / "agent.py").write_text(FAULTY_AGENT)
    state = Runtime(cfg, console=Console(file=io.StringIO())).run()
    assert state.completed == 1

    store = Store(tmp_path / "run/store.sqlite")
    rollouts = store.rollouts(phase="train")
    assert len(rollouts) == 2 * len(rows) and not [r for r in rollouts if r.status == "running"]
    seen = {}
    for r in rollouts:
        fault = store.task(r.task_id).get("fault")
        status, expected = FAULTS.get(fault, ("succeeded", 0.0))
        assert r.status == status, (fault, r.status, r.error)
        if status == "failed":
            assert expected in r.error, (fault, r.error)
            assert fault == "1e200" or "fails this rollout only" in r.error, (fault, r.error)  # a raise, not a value
        elif isinstance(expected, str):
            assert r.output == expected, (fault, r.output)  # stored as its repr
        else:
            assert r.reward == expected, (fault, r.reward)  # the mutated task reached neither reward nor group
        seen[fault] = r.status
    assert set(seen) == set(FAULTS) | {None}
    (m,) = metrics(tmp_path / "run")
    assert m["rollout/failed"] == 12 and math.isfinite(m["rollout/reward_mean"])


def test_two_runs_on_one_run_directory_the_second_is_refused(tmp_path):
    import subprocess
    import sys

    rows = [task(a, 2) for a in range(1, 5)]
    cfg = make_project(tmp_path, rows, run='name = "faults"\ndir = "run"\niterations = 2',
                       rollout="concurrency = 16\ntimeout = 600.0")
    # The first run's rollouts wait for the test's word, so it is surely still running while the second starts.
    release = tmp_path / "release"
    (tmp_path / "agent.py").write_text(AGENT.replace("CALLS", "1").replace("PAUSE", "0").replace(
        "    fault = task.get(\"fault\")\n    text = asyncio.run", f"    fault = task.get(\"fault\")\n"
        f"    import os, time\n    while not os.path.exists({str(release)!r}):\n        time.sleep(0.05)\n"
        f"    text = asyncio.run", 1))
    first = threading.Thread(target=Runtime(cfg, console=Console(file=io.StringIO())).run, daemon=True)
    first.start()
    db = tmp_path / "run/store.sqlite"
    _wait(lambda: _running(db) >= 1, "the first run's collection")
    for flag in ("--resume", "--overwrite"):
        second = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "run", flag], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300)
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert out.startswith("error: run.dir ") and "another `lightning run` is using it" in out, out
        assert f"pid {os.getpid()}" in out and out.strip().count("\n") == 0
    assert db.exists()  # --overwrite deleted nothing of the run in progress
    release.write_text("go")
    first.join(timeout=300)
    assert not first.is_alive()
    assert [m["iteration"] for m in metrics(tmp_path / "run")] == [1, 2]  # the first run was not disturbed


def test_leftovers_of_a_killed_swap_put_the_previous_directory_back(tmp_path):
    """The state on disk when atomic_dir(replace=True) is killed between its two renames: the old copy is in
    `.NAME.old-*`, the new one in `.NAME.tmp-*`, and NAME is missing. The next start puts the old one back."""
    from lightning_sdk.files import clean_atomic_leftovers

    (tmp_path / ".iter-00002.old-abc/iter-00002").mkdir(parents=True)
    (tmp_path / ".iter-00002.old-abc/iter-00002/state.json").write_text("{}")
    (tmp_path / ".iter-00002.tmp-def").mkdir()
    (tmp_path / "iter-00001").mkdir()
    assert clean_atomic_leftovers(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-00001", "iter-00002"]
    assert (tmp_path / "iter-00002/state.json").read_text() == "{}"


def _running(db: Path) -> int:
    if not db.exists():
        return 0
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return c.execute("SELECT COUNT(*) FROM rollouts WHERE status = 'running'").fetchone()[0]
    except sqlite3.OperationalError:
        return 0
    finally:
        c.close()


def test_a_checkpoint_from_before_the_change_still_loads_and_leaves_random_alone(tmp_path, tiny_model_path):
    """Older checkpoints saved Python's `random` state in rng.pt; loading one must work and not restore it."""
    import random

    import torch

    from lightning_sdk.config import TrainConfig
    from lightning_sdk.train.trainer import GRPOTrainer

    cfg = TrainConfig(lora_r=4)
    GRPOTrainer(tiny_model_path, cfg).save_state(tmp_path / "ckpt")
    rng = torch.load(tmp_path / "ckpt/rng.pt")
    assert "python" not in rng
    random.seed(7)
    torch.save({**rng, "python": random.getstate()}, tmp_path / "ckpt/rng.pt")  # the old layout
    random.seed(99)
    expected = random.Random(99).random()
    GRPOTrainer(tiny_model_path, cfg).load_state(tmp_path / "ckpt")
    assert random.random() == expected  # the global `random` was not rewound to the checkpoint's state
