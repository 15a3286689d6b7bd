"""What a person reads of a run: its first line at once, also in a log file; a table without columns the run's
settings keep at zero, that says what logprob gap means and what the eval scored; a one-line repr of the result;
nothing at all from `ls.run(quiet=True)`, and no warning in server.log; `lightning eval` naming the iteration it
scored, with the same score twice, its rollouts kept for `lightning traces`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from lightning_sdk.api import RunResult
from lightning_sdk.evals import EvalScore
from lightning_sdk.summary import iteration_table
from lightning_sdk.train.checkpoint import RunState

ROOT = Path(__file__).resolve().parents[1]
ROW = {"iteration": 1, "policy": "builtin:tiny-arith", "reward_mean": 0.25, "reward_std": 0.1, "failed": 0,
       "transitions": 32, "train.loss": 0.01, "train.kl": 0.0, "train.logprob_gap": 0.002, "collect_s": 3.0,
       "update_s": 1.0}


def rendered(beta: float, split: str = "train") -> str:
    console = Console(record=True, width=200)
    before, after = EvalScore(0.1, 0.03, 100, split), EvalScore(0.5, 0.05, 100, split)
    console.print(iteration_table("arith", [ROW] * 3, before, after, beta=beta))
    return console.export_text()


def test_the_table_leaves_out_kl_without_beta_and_says_what_logprob_gap_is():
    plain, with_kl = rendered(beta=0.0), rendered(beta=0.04)
    header = lambda text: next(line for line in text.splitlines() if "logprob gap" in line and "┃" in line)  # noqa
    assert " kl " not in header(plain) and " kl " in header(with_kl)
    assert "logprob gap: mean |trainer - server| log-prob per sampled token" in plain


def test_the_table_says_what_the_eval_scored_with_its_standard_error():
    on_train, held_out = rendered(0.0, "train"), rendered(0.0, "held-out")
    assert "eval rows: score on the training tasks, mean ± standard error over 100 tasks" in on_train
    assert "held-out" not in on_train and "eval rows: held-out score" in held_out
    assert "0.100 ± 0.030" in on_train and "0.500 ± 0.050" in on_train


# Runs the CLI with a finder that prints a line the moment torch is first imported: an order, not a time, so the
# test holds on a loaded machine.
TORCH_MARK = "<torch imported>"
WITH_IMPORT_MARK = f"""
import runpy, sys
class Mark:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print({TORCH_MARK!r}, flush=True)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Mark())
sys.argv = ["lightning"] + sys.argv[1:]
runpy.run_module("lightning_sdk.cli", run_name="__main__")
"""


def test_the_first_line_comes_at_once_in_a_log_file(tmp_path):
    for name in ("agent.py", "data/train.jsonl"):  # the default run's agent and data
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text((ROOT / "cookbook/arith" / name).read_text())
    (tmp_path / "lightning.toml").write_text('[agent]\nmodule = "agent.py"\n\n[data]\ntrain = "data/train.jsonl"\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("COLUMNS", None)
    start = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", WITH_IMPORT_MARK, "run", "--run-dir", str(tmp_path / "run")],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = p.stdout.readline()  # a pipe, as a log file: block-buffered output would hold it back
        took = time.monotonic() - start
        later = []  # the mark shows the finder works: torch does come, after the first line
        while TORCH_MARK + "\n" not in later and len(later) < 3:
            later.append(p.stdout.readline())
    finally:
        p.kill()
        p.wait(30)
    print(f"first line after {took:.2f} s: {first!r}, then {later!r}")
    assert first.startswith("run 'run': ") and "starting the model server" in first
    # the interpreter, the config, the agent and the data checked: the trainer's imports come after
    assert TORCH_MARK + "\n" in later


def test_a_run_result_reads_in_one_line(tmp_path):
    state = RunState()
    state.history = [dict(ROW, iteration=k) for k in range(1, 31)]
    state.completed = 30
    text = repr(RunResult(run_dir=tmp_path, state=state, eval_untrained=0.24, eval_trained=0.8512,
                          eval_trained_stderr=0.0361))
    assert "\n" not in text and len(text) < 200 and "reward_mean" not in text
    assert "iterations=30" in text and "eval_trained=0.851±0.036" in text and "eval_untrained=0.240," in text


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """The default run's agent and config, made short (12 tasks, 2 iterations), through `ls.run(quiet=True)` in a
    process of its own; data.eval is the training file, as in the default run."""
    d = tmp_path_factory.mktemp("quiet")
    (d / "agent.py").write_text((ROOT / "cookbook/arith/agent.py").read_text())
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9]) + "\n")
    toml = (ROOT / "lightning.toml").read_text()
    for old, new in (('dir = "runs/arith"', 'dir = "run"'), ("iterations = 30", "iterations = 2"),
                     ('"cookbook/arith/agent.py"', '"agent.py"'),
                     ('"cookbook/arith/data/train.jsonl"', '"train.jsonl"'),
                     ("tasks_per_iteration = 16", "tasks_per_iteration = 4"), ("group_size = 8", "group_size = 4")):
        assert old in toml
        toml = toml.replace(old, new)
    (d / "lightning.toml").write_text(toml)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", "import lightning_sdk as ls; ls.run('lightning.toml', quiet=True)"],
                       cwd=d, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return d, p


def test_a_quiet_run_prints_nothing(quiet_run):
    _, p = quiet_run
    assert p.stdout == ""
    print("stderr:", p.stderr)
    assert p.stderr == ""


def test_the_default_run_leaves_no_warning_in_its_server_log(quiet_run):
    d, _ = quiet_run
    log = (d / "run/server.log").read_text()
    assert "loaded lora adapter arith-iter2" in log and "unloaded lora adapter arith-iter1" in log  # hot-loads ran
    noisy = [line for line in log.splitlines() if "warn" in line.lower() or "deprecat" in line.lower()]
    assert noisy == []


def lightning(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "lightning_sdk.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_evals_on_the_training_file_say_so_with_their_standard_error(quiet_run):
    d, _ = quiet_run
    rows = [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("phase") == "eval"]
    assert [(r["eval"], r["eval/split"], r["eval/tasks"]) for r in evals] == [("untrained", "train", 12),
                                                                              ("trained", "train", 12)]
    assert all(0 < r["eval/stderr"] < 0.3 for r in evals if 0 < r["eval/reward_mean"] < 1)


def test_lightning_eval_names_the_iteration_scores_the_same_twice_and_keeps_its_rollouts(quiet_run):
    d, _ = quiet_run
    first, second = (lightning("eval", "--trained", cwd=d) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stdout + first.stderr
    line = re.compile(r"score on the training tasks (\d\.\d{3} ± \d\.\d{3}) over 12 tasks \(mean reward ± standard "
                      r"error\) of iteration 2 \(checkpoint .*iter-00002, served as arith-iter2\)")
    scores = [line.search(out.stdout) for out in (first, second)]
    assert all(scores), first.stdout
    assert scores[0].group(1) == scores[1].group(1)  # run.seed fixes each eval rollout's sample
    assert "held-out" not in first.stdout
    kept = sorted((d / "run/evals").glob("*.sqlite"))
    assert len(kept) == 2 and all(k.name.endswith("-iter2.sqlite") for k in kept)  # one file per eval, none replaced
    assert f"eval rollouts: {kept[0]}" in first.stdout or f"eval rollouts: {kept[1]}" in first.stdout
    listed = lightning("traces", "--run-dir", "run", "--phase", "eval", "-n", "100", cwd=d)
    assert listed.returncode == 0, listed.stderr
    # the run's own two evals, then each kept store's one
    assert listed.stdout.count("eval-untrained-") == 12 and listed.stdout.count("eval-trained-") == 12 + 2 * 12
    assert not re.search(r"\bit0\d{3}-", listed.stdout)  # no training rollout
    assert sorted((d / "run/evals").iterdir()) == kept  # complete files only: no temp, and the reader left no -wal
