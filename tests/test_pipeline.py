"""Pipelined training (train.max_staleness = k >= 1): collection overlaps the update, every call's staleness is
bounded and weighted, faults (a trainer error, kill -9, Ctrl-C) lose nothing and repeat no update."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from lightning_sdk import config
from lightning_sdk.errors import SetupError
from lightning_sdk.pipeline import UpdateThread, split_stale
from lightning_sdk.runtime import Runtime
from lightning_sdk.servers.select import cpu_threads, make_server, usable_cores
from lightning_sdk.transitions import Transition
from tests.test_e2e import _kill9, _query, _start, _wait_for, arith_project, lightning
from tests.test_runtime_faults import make_project, metrics, task


def transition(policy: str | None) -> Transition:
    return Transition(rollout_id="r", group_id="g", span_id=f"s-{policy}", index=0, component=None, prompt_ids=(1,),
                      completion_ids=(2,), logprobs=(-0.5,), reward=1.0, policy=policy)


def test_split_stale_keeps_calls_at_most_k_updates_behind_and_counts_the_rest():
    versions = {"base": 0, "run-iter1": 1, "run-iter2": 2, "run-iter3": 3}
    ts = [transition(p) for p in ("run-iter3", "run-iter2", "run-iter1", "base", None)]
    kept, stale = split_stale(ts, versions, trained=3, max_staleness=1)  # batch 4 trains from version 3
    assert [t.policy for t in kept] == ["run-iter3", "run-iter2"]
    assert (stale.mean, stale.max, stale.dropped) == (0.5, 1, 3)  # an unrecorded adapter counts as the oldest
    assert stale.metrics() == {"staleness_mean": 0.5, "staleness_max": 1.0, "stale_dropped": 3.0}
    kept, stale = split_stale(ts, versions, trained=3, max_staleness=3)
    assert len(kept) == 5 and stale.max == 3 and stale.dropped == 0


def test_update_thread_runs_updates_in_order_and_hands_back_the_first_error():
    done: list[int] = []
    gate = threading.Event()
    updates = UpdateThread(first=2)
    updates.done(2)  # the checkpoint's updates: nothing to wait for
    updates.submit(3, lambda: (gate.wait(10), done.append(3)))
    updates.submit(4, lambda: done.append(4))
    assert done == []
    gate.set()
    updates.done(4)
    assert done == [3, 4]

    def fails():
        raise FloatingPointError("the trainer's own message")

    updates.submit(5, fails)
    updates.submit(6, lambda: done.append(6))  # never runs: the run stops at the first failed update
    with pytest.raises(FloatingPointError, match="the trainer's own message"):
        updates.done(6)
    with pytest.raises(FloatingPointError):
        updates.submit(7, lambda: None)
    updates.close(cancel=True)
    assert done == [3, 4]


def test_staleness_needs_the_importance_weight_and_vllm_awake(tmp_path):
    head = "[agent]\nmodule = 'agent.py'\n[data]\ntrain = 'train.jsonl'\n[train]\n"
    for body, expected in (("max_staleness = 1\nimportance_sampling_cap = 'off'\n",
                            r"train.max_staleness = 1 trains on samples of older adapters.*not 'off'"),
                           ("max_staleness = -1\n", r"train.max_staleness")):
        (tmp_path / "bad.toml").write_text(head + body)
        with pytest.raises(config.ConfigError, match=expected):
            config.load(tmp_path / "bad.toml")
    cfg = make_project(tmp_path, [task(1, 2)] * 4, train="max_staleness = 1", serve='backend = "vllm"')
    with pytest.raises(SetupError, match=r"train.max_staleness = 1 .* serve.sleep_level = 1 .* "
                                         r"set serve.sleep_level = 0"):
        Runtime(cfg, console=Console(file=io.StringIO())).run()
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_the_cpu_is_shared_out_between_the_server_and_the_trainer(tmp_path, monkeypatch):
    """Alternating: the built-in server leaves a core to the agents and the gateway, the trainer (alone while it
    runs) keeps torch's default; pipelined: the cores split; OMP_NUM_THREADS, when set, decides for both."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    rows = [task(1, 2)] * 4
    for d in "apv":
        (tmp_path / d).mkdir()
    alternating = make_project(tmp_path / "a", rows)
    pipelined = make_project(tmp_path / "p", rows, train="max_staleness = 1")
    assert cpu_threads(alternating) == (max(1, cores - 1), None)
    assert cpu_threads(pipelined) == (cores - cores // 2, max(1, cores // 2))
    assert make_server(alternating, "builtin:tiny-arith", tmp_path / "s.log").threads == max(1, cores - 1)
    assert cpu_threads(make_project(tmp_path / "v", rows, serve='backend = "vllm"')) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads(alternating) is None and cpu_threads(pipelined) is None
    assert make_server(alternating, "builtin:tiny-arith", tmp_path / "s.log").threads is None


def _calls(db, iteration: int) -> list[str]:
    """The adapter the gateway recorded as serving each LLM call of an iteration's training rollouts."""
    rows = _query(db, "SELECT s.attributes FROM spans s JOIN rollouts r USING (rollout_id) WHERE r.iteration = ? "
                      "AND r.phase = 'train' AND s.source = 'gateway'", iteration)
    return [json.loads(a)["lightning.llm.policy"] for (a,) in rows]


def test_pipelined_run_overlaps_collection_with_the_update_and_weights_each_stale_call(tmp_path):
    rows = [task(a, b) for a in range(1, 4) for b in range(1, 4)]
    cfg = make_project(tmp_path, rows, calls=2, pause=0.05,
                       run='name = "pipe"\ndir = "run"\niterations = 4',
                       rollout="concurrency = 16\ntimeout = 120.0",
                       train="lora_r = 4\nmicro_batch_size = 4\nepochs = 2\nmax_staleness = 1")
    Runtime(cfg, console=Console(file=io.StringIO())).run()
    run, db = tmp_path / "run", tmp_path / "run/store.sqlite"
    ms = metrics(run)
    assert [m["iteration"] for m in ms] == [1, 2, 3, 4] and [m["train/step"] for m in ms] == [1, 2, 3, 4]
    assert (run / "checkpoints/iter-00004/state.json").exists()
    # Batch 1 comes from the base model, which update 1 also starts from: nothing stale.
    (base,) = set(_calls(db, 1))
    assert ms[0]["train/staleness_max"] == 0 and not base.startswith("pipe-iter")
    for m in ms:
        assert m["train/stale_dropped"] == 0 and m["train/staleness_max"] <= 1
        assert 0 < m["train/is_weight"] < 2.0 + 1e-6 and 0 <= m["train/is_capped_frac"] <= 1  # the cap is 2 (auto)
    # Batch 2 was collected while update 1 ran: its first calls were served by the base model, one update behind
    # the adapter update 2 starts from. That is the overlap, seen from the gateway's records.
    assert ms[1]["train/staleness_max"] == 1 and base in _calls(db, 2)
    for n in (3, 4):  # never more than one update behind; the newest adapter served as soon as it was saved
        assert set(_calls(db, n)) <= {f"pipe-iter{n - 2}", f"pipe-iter{n - 1}"}, _calls(db, n)
    assert ms[-1]["time/elapsed_s"] > ms[0]["time/elapsed_s"] > 0


def test_a_trainer_error_stops_a_pipelined_run_with_the_trainers_message(tmp_path, monkeypatch):
    from lightning_sdk.train.trainer import GRPOTrainer

    step = GRPOTrainer.step

    def failing(self, transitions, scored=None):
        if self.global_step == 1:  # the second update fails, while batch 3 is being collected
            raise FloatingPointError("injected: the trainer's own message")
        return step(self, transitions, scored)

    monkeypatch.setattr(GRPOTrainer, "step", failing)
    cfg = make_project(tmp_path, [task(a, 1) for a in range(1, 9)], run='name = "pipe"\ndir = "run"\niterations = 5',
                       rollout="concurrency = 16\ntimeout = 120.0",
                       train="lora_r = 4\nmicro_batch_size = 16\nmax_staleness = 1")
    t0 = time.monotonic()
    with pytest.raises(FloatingPointError, match="injected: the trainer's own message"):
        Runtime(cfg, console=Console(file=io.StringIO())).run()
    assert time.monotonic() - t0 < 240
    run = tmp_path / "run"
    assert [m["iteration"] for m in metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").glob("iter-*")) == ["iter-00001"]
    # No more than one batch was collected beyond the failed update: batch 3 began before update 2 failed.
    iterations = {it for (it,) in _query(run / "store.sqlite", "SELECT DISTINCT iteration FROM rollouts")}
    assert iterations <= {1, 2, 3}


@pytest.fixture()
def project(tmp_path):
    """The e2e project, 3 iterations without eval, updates long enough to be caught running, pipelined."""
    arith_project(tmp_path)
    toml = (tmp_path / "lightning.toml").read_text().replace('eval = "eval.jsonl"\n', "")
    (tmp_path / "lightning.toml").write_text(toml.replace("iterations = 2", "iterations = 3").replace(
        "micro_batch_size = 8", "micro_batch_size = 4\nepochs = 4\nmax_staleness = 1"))
    return tmp_path


def test_ctrl_c_then_kill_9_during_overlapped_updates_then_resume_loses_nothing_and_repeats_no_update(project):
    """Ctrl-C while batch 2 is collected beside update 1: the update finishes and saves, the run exits 130.
    --resume, then kill -9 once batch 3 is collected (an update running or queued beside it). The last --resume
    keeps every stored rollout and span, and in the end each update happened exactly once."""
    run, db = project / "run", project / "run/store.sqlite"
    spans = lambda: {r[0]: r[1:] for r in _query(  # noqa: E731
        db, "SELECT span_id, rollout_id, name, attributes, start_ns FROM spans")}
    rollouts = lambda: {r[0] for r in _query(db, "SELECT rollout_id FROM rollouts")}  # noqa: E731

    log = project / "first.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run"], cwd=project, env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: len(_query(db, "SELECT 1 FROM spans JOIN rollouts USING (rollout_id) WHERE iteration = 2"))
              >= 1, "iteration 2 collection", proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, log.read_text()
    assert "interrupted: `lightning run --resume` continues" in log.read_text()
    # Whatever update was running when Ctrl-C came finished and saved: every row has its checkpoint.
    rows = [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    ckpts = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("iter-*"))
    assert rows == ckpts and ckpts[0] == 1, (rows, ckpts)
    assert not list(run.glob("checkpoints/.*"))  # no half-written checkpoint
    spans_1, rollouts_1 = spans(), rollouts()

    proc = _start("run", "--resume", cwd=project)
    done = "SELECT COUNT(*) FROM rollouts WHERE iteration = 3 AND status = 'succeeded'"
    _wait_for(lambda: (_query(db, done) or [(0,)])[0][0] == 16, "batch 3 collected", proc)
    _kill9(proc)
    spans_2, rollouts_2 = spans(), rollouts()
    assert all(spans_2.get(i) == c for i, c in spans_1.items()) and rollouts_1 <= rollouts_2

    final = lightning("run", "--resume", cwd=project)
    assert final.returncode == 0, final.stdout + final.stderr
    after = spans()
    assert all(after.get(i) == c for i, c in {**spans_1, **spans_2}.items())  # no span lost or overwritten
    assert rollouts_2 <= rollouts()
    ms = metrics(run)
    state = json.loads((run / "checkpoints/iter-00003/state.json").read_text())
    trainer_state = json.loads((run / "checkpoints/iter-00003/trainer/trainer_state.json").read_text())
    assert [m["iteration"] for m in ms] == [1, 2, 3] == [r["iteration"] for r in state["history"]]
    assert [m["train/step"] for m in ms] == [1, 2, 3] and trainer_state["global_step"] == 3
    trained = dict(_query(db, "SELECT iteration, COUNT(*) FROM rollouts WHERE phase = 'train' AND status = "
                              "'succeeded' GROUP BY iteration"))
    assert trained == {1: 16, 2: 16, 3: 16}  # the rest of what the stopped runs collected is marked untrained
    assert _query(db, "SELECT COUNT(*) FROM rollouts WHERE status = 'running'") == [(0,)]


@pytest.mark.parametrize("when", ["collecting", "waiting"])
def test_ctrl_c_during_an_overlapped_update_stops_the_run_after_it_saves(tmp_path, monkeypatch, when):
    """Ctrl-C reaches the main thread at a chosen moment of update 1, never by luck of timing: while batch 2 is
    collected beside it ("collecting"), or once batch 2 is in and the main thread waits for update 1 ("waiting").
    Update 1 finishes and saves; the run ends with KeyboardInterrupt (the CLI's exit 130), even when stopping then
    fails too (spans that do not drain in time on a loaded machine); update 2 never runs."""
    from lightning_sdk import pipeline
    from lightning_sdk.rollouts.embedded import EmbeddedCollector
    from lightning_sdk.train.trainer import GRPOTrainer

    step, collect, done = GRPOTrainer.step, EmbeddedCollector.collect, pipeline.UpdateThread.done
    batch2, batch2_over, waiting, steps = threading.Event(), threading.Event(), threading.Event(), []

    def collecting(self, jobs, policy, *, label):
        if label.startswith("iteration 2/"):
            batch2.set()
        try:
            return collect(self, jobs, policy, label=label)
        finally:
            if label.startswith("iteration 2/"):
                batch2_over.set()

    def waits(self, n):
        if n == 1:  # batch 3's turn: it waits for update 1
            waiting.set()
        return done(self, n)

    def interrupted(self, transitions, scored=None):
        steps.append(self.global_step + 1)
        if self.global_step == 0:
            assert (batch2 if when == "collecting" else waiting).wait(120)
            if when == "waiting":
                time.sleep(0.5)  # the main thread is blocked in the wait by now
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            sent.set()
            if when == "collecting":
                assert batch2_over.wait(120)  # the collection was stopped while this update still runs
        return step(self, transitions, scored)

    def slow_spans(*args, **kw):  # a loaded machine: the span writer does not drain in time while stopping
        if sent.is_set():
            raise TimeoutError("span writer did not drain within 30s")
        return flush(*args, **kw)

    from lightning_sdk import tracing

    flush, sent = tracing.flush, threading.Event()
    monkeypatch.setattr(tracing, "flush", slow_spans)
    monkeypatch.setattr(EmbeddedCollector, "collect", collecting)
    monkeypatch.setattr(pipeline.UpdateThread, "done", waits)
    monkeypatch.setattr(GRPOTrainer, "step", interrupted)
    cfg = make_project(tmp_path, [task(a, 1) for a in range(1, 9)], calls=2, pause=0.2,
                       run='name = "pipe"\ndir = "run"\niterations = 4',
                       rollout="concurrency = 16\ntimeout = 120.0",
                       train="lora_r = 4\nmicro_batch_size = 16\nmax_staleness = 1")
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):  # not the teardown's TimeoutError in its place
        Runtime(cfg, console=Console(file=out, width=200)).run()
    assert "while stopping: TimeoutError: span writer did not drain within 30s" in out.getvalue()
    run = tmp_path / "run"
    assert steps == [1]  # update 1 ran to its end; update 2 never started
    assert [m["iteration"] for m in metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").glob("iter-*")) == ["iter-00001"]
    iterations = {it for (it,) in _query(run / "store.sqlite", "SELECT DISTINCT iteration FROM rollouts")}
    assert 3 not in iterations and 1 in iterations  # nothing of batch 3 was collected after the Ctrl-C
