"""Issue 52 item 10: the workers a `run.runtime = "processes"` run starts end with it (kill -9 of the run
included), and one killed while the run goes on is said and replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

AGENT = '''
import time
from openai import OpenAI
import lightning_sdk as ls

@ls.rollout
def solve(task, llm):
    time.sleep(120)  # still running when the test kills things
    return "late"

@ls.reward
def score(task, output):
    return 1.0
'''

WORKERS = 3


def start_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    (tmp_path / "lightning.toml").write_text(
        '[run]\nname = "procs"\ndir = "run"\niterations = 1\nruntime = "processes"\n[agent]\nmodule = "agent.py"\n'
        f'[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 1\ngroup_size = {WORKERS}\n'
        f'[model]\ndtype = "float32"\n[rollout]\nconcurrency = {WORKERS}\ntimeout = 200.0\n[train]\nlora_r = 4\n')
    out = tmp_path / "out.log"
    with out.open("w") as f:
        run = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run", "-c", "lightning.toml"], cwd=tmp_path,
                               stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd(),
                                                                        "COLUMNS": "400"})
    return run, out


def workers_of(run: subprocess.Popen) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(run.pid).children():
        try:
            if " worker " in f" {' '.join(p.cmdline())} " and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_for(what, timeout: float, why: str, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < deadline, f"{why}; the run's output: {log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.2)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def worker_claimed(tmp_path: Path) -> bool:
    log = tmp_path / "run" / "workers.log"
    return log.exists() and log.read_text(errors="replace").count("rollout(s) at a time") >= WORKERS


@contextmanager
def running_workers(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path, list[psutil.Process]]]:
    """A processes run whose workers have all connected: (the run, its output, its workers: a list the test may
    extend with workers it started); whatever is left of them is killed after."""
    run, out = start_run(tmp_path)
    workers: list[psutil.Process] = []
    try:
        workers += wait_for(lambda: len(workers_of(run)) == WORKERS and workers_of(run), 240,
                            "the run did not start its workers", out)
        wait_for(lambda: worker_claimed(tmp_path), 120, "the workers did not connect", out)
        yield run, out, workers
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for p in alive(workers):
            p.kill()


def test_the_workers_of_a_run_killed_with_minus_9_end_with_it(tmp_path):
    with running_workers(tmp_path) as (run, out, workers):
        run.kill()  # kill -9: no stop() runs
        run.wait()
        wait_for(lambda: not alive(workers), 20, f"workers {[p.pid for p in alive(workers)]} outlived their run "
                                                 f"(killed with -9) by 20 s", out)


def test_a_killed_worker_is_said_and_replaced(tmp_path):
    with running_workers(tmp_path) as (run, out, workers):
        victim = workers[0]
        victim.kill()
        line = wait_for(lambda: next((x for x in out.read_text(errors="replace").splitlines()
                                      if f"rollout worker {victim.pid} ended" in x), None), 30,
                        "the killed worker was not said", out)
        assert "SIGKILL" in line and "in its place" in line, line
        replaced = wait_for(lambda: len(workers_of(run)) == WORKERS and workers_of(run), 30,
                            "the killed worker was not replaced", out)
        assert victim.pid not in {p.pid for p in replaced}
        workers += replaced
