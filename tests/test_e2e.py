"""End to end: `lightning run` on the tiny model, as a subprocess, `lightning traces`, and `--resume` after kill -9."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdk.store import Store

ROOT = Path(__file__).resolve().parents[1]


def lightning(*args, cwd, timeout=400):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "lightning_sdk.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return arith_project(tmp_path_factory.mktemp("project"))


def arith_project(d: Path) -> Path:
    """A small copy of the default job in `d`: the arith agent, 12 training and 5 eval tasks, 2 iterations."""
    shutil.copy(ROOT / "cookbook/arith/agent.py", d / "agent.py")
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9]) + "\n")  # 12 tasks
    (d / "eval.jsonl").write_text("\n".join(rows[::20]) + "\n")  # 5 tasks
    (d / "lightning.toml").write_text("""
[run]
name = "e2e"
dir = "run"
iterations = 2
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
tasks_per_iteration = 4
group_size = 4
[model]
name = "builtin:tiny-arith"
dtype = "float32"
[rollout]
concurrency = 8
[train]
lr = 2e-3
lora_r = 8
micro_batch_size = 8
""")
    return d


def test_run_trains_and_writes_everything(project):
    first = lightning("run", cwd=project)
    assert first.returncode == 0, first.stdout + first.stderr
    run = project / "run"
    assert "reward per iteration" in first.stdout and "untrained" in first.stdout and "trained" in first.stdout

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if r.get("phase") != "eval"]
    assert [(r["eval"], r["iteration"]) for r in lines if r.get("phase") == "eval"] == [("untrained", 0), ("trained", 2)]
    assert [r["iteration"] for r in rows] == [1, 2]  # numbered from 1, as in the table
    assert all(r["rollout/transitions"] == 16 and r["rollout/rollouts"] == 16 for r in rows)
    assert rows[0]["policy"] == "builtin:tiny-arith" and rows[1]["policy"] == "e2e-iter1"
    assert (run / "reward_curve.png").stat().st_size > 0 and any((run / "tensorboard").iterdir())

    store = Store(run / "store.sqlite")
    train = store.rollouts(phase="train")
    assert len(train) == 32 and all(r.status == "succeeded" for r in train)
    assert {r.model for r in train if r.iteration == 2} == {"e2e-iter1"}  # iteration 2 sampled the new adapter
    assert len(store.rollouts(phase="eval")) == 10
    assert store.count("spans") >= 42  # one LLM call per rollout

    adapter = run / "checkpoints/iter-00002/trainer/adapter"
    assert (adapter / "adapter_config.json").exists()

    # The served model changed: the trained adapter gives different log-probs than the base for the same prompt.
    from peft import PeftModel

    from lightning_sdk import models
    import torch

    path = models.resolve("builtin:tiny-arith")
    tok = models.load_tokenizer(path)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is 4 + 4?"}],
                                                add_generation_prompt=True)["input_ids"]])
    base = models.load_causal_lm(path, dtype="float32")
    with torch.no_grad():
        before = base(ids).logits[0, -1].log_softmax(-1)
        tuned = PeftModel.from_pretrained(base, str(adapter))
        after = tuned(ids).logits[0, -1].log_softmax(-1)
    assert (after - before).abs().max() > 1e-3

    # --resume (with --iterations overriding the file, as when extending a finished run) is tested after
    # kill -9 at observed moments by test_kill_9_during_collection_and_during_update_then_resume_loses_nothing.

    traces = lightning("traces", "--run-dir", str(run), "-n", "5", cwd=project)
    assert traces.returncode == 0 and "succeeded" in traces.stdout
    assert f"{Store(run / 'store.sqlite').count('rollouts')} rollouts" in traces.stdout

    # Running again without --resume refuses to touch the existing run.
    again = lightning("run", cwd=project)
    assert again.returncode == 2 and "already holds a run" in again.stdout + again.stderr


def test_bad_config_exits_2_naming_the_key(project, tmp_path):
    bad = tmp_path / "lightning.toml"
    bad.write_text((project / "lightning.toml").read_text().replace("lr = 2e-3", "learning_rate = 2e-3"))
    out = lightning("run", "-c", str(bad), cwd=project)
    assert out.returncode == 2 and "train.learning_rate: unknown key" in out.stdout + out.stderr


def test_agent_that_bypasses_the_server_is_a_loud_capture_error(project, tmp_path):
    """'0 transitions' never becomes an empty update: the run stops and names the rollout."""
    (tmp_path / "agent.py").write_text(
        "import lightning_sdk as ls\n\n"
        "@ls.rollout\n"
        "def solve(task, llm):\n"
        "    return task['answer']  # never calls the LLM\n\n"
        "@ls.reward\n"
        "def score(task, output):\n"
        "    return 1.0\n")
    shutil.copy(project / "train.jsonl", tmp_path / "train.jsonl")
    text = (project / "lightning.toml").read_text().replace('eval = "eval.jsonl"\n', "")
    (tmp_path / "lightning.toml").write_text(text)
    out = lightning("run", cwd=tmp_path)
    assert out.returncode == 1
    assert "no LLM call was captured" in out.stdout and "(e.g. rollout it0001-" in out.stdout
    assert "made an LLM call the gateway could attribute to it" in out.stdout
    assert "`lightning check` shows each rollout" in out.stdout
    assert "no eval: data.eval is not set" in out.stdout  # the file has no data.eval: the run says so


# ------------------------------------------------------------------------------------ kill -9, then --resume

def _query(db: Path, sql: str, *args) -> list[tuple]:
    import sqlite3

    if not db.exists():
        return []
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return c.execute(sql, args).fetchall()
    except sqlite3.OperationalError:  # the schema is not written yet
        return []
    finally:
        c.close()


def _wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.03)


def _start(*args, cwd) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    return subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _kill9(proc: subprocess.Popen) -> None:
    import signal

    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def test_kill_9_during_collection_and_during_update_then_resume_loses_nothing(project, tmp_path):
    """SIGKILL the whole `lightning run` at moments observed in its store, resume each time: every rollout and
    span written before a kill is still there afterwards, and each training step happens exactly once."""
    import re
    import time

    for name in ("agent.py", "train.jsonl"):
        shutil.copy(project / name, tmp_path / name)
    toml = (project / "lightning.toml").read_text().replace('eval = "eval.jsonl"\n', "")
    (tmp_path / "lightning.toml").write_text(toml.replace("micro_batch_size = 8", "micro_batch_size = 4\nepochs = 4"))
    three = ("--iterations", "3")  # the file says 2: the override is what resume must honour too
    run, db = tmp_path / "run", tmp_path / "run/store.sqlite"
    rollouts = lambda: set(_query(db, "SELECT rollout_id, iteration, status FROM rollouts"))  # noqa: E731
    # Content, not just ids: a span id that survives while its rollout, name or attributes change is a lost span.
    spans = lambda: {r[0]: r[1:] for r in _query(  # noqa: E731
        db, "SELECT span_id, rollout_id, name, attributes, start_ns FROM spans")}
    checkpoints = lambda: sorted(p.name for p in (run / "checkpoints").glob("iter-*"))  # noqa: E731

    # 1. Kill during collection: iteration 2 has rollouts running and LLM calls stored.
    proc = _start("run", *three, cwd=tmp_path)
    _wait_for(lambda: len(_query(db, "SELECT 1 FROM spans JOIN rollouts USING (rollout_id) WHERE iteration = 2"))
              >= 2, "iteration 2 collection", proc)
    _kill9(proc)
    server_pid = int(re.findall(r"Started server process \[(\d+)\]", (run / "server.log").read_text())[-1])
    before_1, spans_1 = rollouts(), spans()
    assert checkpoints() == ["iter-00001"] and any(s == "running" for _, _, s in before_1)
    # Its server, orphaned by the SIGKILL, notices and exits by itself instead of holding the port and memory.
    deadline = time.monotonic() + 60
    while not _gone(server_pid):
        assert time.monotonic() < deadline, "the orphaned server did not exit"
        time.sleep(0.2)

    # 2. Resume, then kill during the update of iteration 3: all its rollouts done, no checkpoint yet.
    proc = _start("run", "--resume", *three, cwd=tmp_path)
    done = "SELECT COUNT(*) FILTER (WHERE status = 'succeeded'), COUNT(*) FILTER (WHERE status = 'running') " \
           "FROM rollouts WHERE iteration = 3"
    _wait_for(lambda: (_query(db, done) or [(0, 1)])[0] == (16, 0), "iteration 3 update", proc)
    _kill9(proc)
    before_2, spans_2 = rollouts(), spans()
    assert checkpoints() == ["iter-00001", "iter-00002"]  # killed inside the update, before its checkpoint
    assert {rid for rid, _, s in before_1 if s == "running"} <= {rid for rid, _, s in before_2 if s == "abandoned"}

    # A checkpoint write killed half-way (a real SIGKILL inside atomic_dir) leaves its hidden temp directory.
    writer = ("import os, signal, sys\nfrom lightning_sdk.files import atomic_dir\n"
              "with atomic_dir(sys.argv[1]) as tmp:\n    (tmp / 'half').write_text('x')\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    killed = subprocess.run([sys.executable, "-c", writer, str(run / "checkpoints/iter-00003")], timeout=120)
    assert killed.returncode == -9 and len(list((run / "checkpoints").glob(".iter-00003.tmp-*"))) == 1

    # 3. Resume to the end.
    final = lightning("run", "--resume", *three, cwd=tmp_path)
    assert final.returncode == 0, final.stdout + final.stderr
    assert "resumed" in final.stdout and "after iteration 2" in final.stdout
    assert "removed 1 unfinished checkpoint write(s)" in final.stdout
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # cleaned up
    after, spans_after = rollouts(), spans()
    ids_after = {rid for rid, _, _ in after}
    assert {rid for rid, _, _ in before_1 | before_2} <= ids_after  # no rollout lost
    stored = {**spans_1, **spans_2}
    assert all(spans_2[i] == c for i, c in spans_1.items())  # the first resume changed no stored span
    changed = [i for i, c in stored.items() if spans_after.get(i) != c]  # gone, or now another span's content
    assert changed == []  # no span lost or overwritten
    lost = len(changed) + len({r for r, _, _ in before_1 | before_2} - ids_after)
    assert lost == 0
    assert len(stored) >= 8 and len(spans_after) > len(stored)  # the resumed iterations added spans of their own

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    state = json.loads((run / "checkpoints/iter-00003/state.json").read_text())
    trainer_state = json.loads((run / "checkpoints/iter-00003/trainer/trainer_state.json").read_text())
    assert [r["iteration"] for r in rows] == [1, 2, 3] == [r["iteration"] for r in state["history"]]
    assert [r["train/step"] for r in rows] == [1, 2, 3] and trainer_state["global_step"] == 3 == state["completed"]
    assert [r["policy"] for r in rows] == ["builtin:tiny-arith", "e2e-iter1", "e2e-iter2"]

    # The killed iterations' finished rollouts are marked untrained: per iteration, the succeeded rows are the 16
    # an update trained on, beside the rows no checkpoint trained on.
    assert "marked untrained" in final.stdout
    by_status = dict.fromkeys([1, 2, 3], None)
    for it in by_status:
        by_status[it] = dict(_query(db, "SELECT status, COUNT(*) FROM rollouts WHERE iteration = ? AND phase = "
                                        "'train' GROUP BY status", it))
    assert [by_status[it].get("succeeded") for it in (1, 2, 3)] == [16, 16, 16], by_status
    finished_2 = {rid for rid, it, s in before_1 if it == 2 and s == "succeeded"}
    running_2 = {rid for rid, it, s in before_1 if it == 2 and s == "running"}
    assert by_status[3].get("untrained") == 16 and by_status[2].get("untrained", 0) == len(finished_2)
    now = {rid: s for rid, _, s in after}
    assert {now[r] for r in finished_2} <= {"untrained"} and {now[r] for r in running_2} <= {"abandoned"}
    trained_3 = {rid for rid, it, s in after if it == 3 and s == "succeeded"}
    shown = lightning("traces", "--run-dir", str(run), "--checkpoint", "iter-00003", "-n", "100", cwd=tmp_path)
    assert shown.returncode == 0 and "the 16 rollouts iter-00003 trained on" in shown.stdout, shown.stdout
    listed = {w for line in shown.stdout.splitlines() for w in line.split() if w.startswith("it0003-")}
    assert listed == trained_3, shown.stdout
    print(f"kill -9 x2: {len(before_2)} rollouts and {len(stored)} spans stored before the kills, "
          f"{lost} lost or changed after resume ({len(stored) - len(changed)} kept with their content); "
          f"training steps {[r['train/step'] for r in rows]}")
