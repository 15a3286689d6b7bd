"""The data-parallel trainer (train.processes = 2) on the CPU with gloo: real processes, real all-reduce, the tiny
builtin model. Two processes make the same update as one on the same batch, with the base whole in each or sharded
over them (train.shard = 'fsdp'), and resume from the checkpoint process 0 wrote; a killed process stops the next
call with one line, not a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_sdk.config import TrainConfig
from lightning_sdk.errors import RunError
from lightning_sdk.train.checkpoint import ADAPTER
from lightning_sdk.train.ranks import TrainerProcesses
from lightning_sdk.train.trainer import GRPOTrainer
from tests.test_e2e import arith_project, lightning
from tests.test_trainer import mixed_batch

torch.set_num_threads(1)

# beta > 0 and two epochs: the KL's reference pass and the old policy's both run on each process's share.
SETTINGS = dict(device="cpu", micro_batch_size=2, beta=0.04, epochs=2,
                target_modules=["all-linear", "lm_head"])


@pytest.fixture(scope="module")
def two(model_path):
    with TrainerProcesses(model_path, TrainConfig(processes=2, **SETTINGS), threads=2, seed=0) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def sharded(model_path):
    with TrainerProcesses(model_path, TrainConfig(processes=2, shard="fsdp", **SETTINGS), threads=2, seed=0) as ranks:
        yield ranks


def _worst(one: GRPOTrainer, checkpoint: Path) -> float:
    """The largest difference between `one`'s adapter and the one the processes wrote to `checkpoint`."""
    saved = load_file(checkpoint / ADAPTER / "adapter_model.safetensors")
    mine = {n: p.detach() for n, p in one.model.named_parameters() if p.requires_grad}
    assert len(saved) == len(mine) > 0
    assert any("lora_B" in n and mine[n].abs().max() > 0 for n in mine)  # moved: two untouched adapters prove nothing
    return max((saved[k] - mine[n]).abs().max().item() for n in mine for k in saved if k == n.replace(".default", ""))


@pytest.mark.parametrize("ranks", ["two", "sharded"])
def test_two_processes_make_the_same_update_as_one_and_resume(ranks, request, model_path, tok, tmp_path):
    """The same update as one process, whether each process holds the whole base or half of it; then the checkpoint
    process 0 wrote (the adapter and Adam's moments whole, as one process writes them) resumes: a step taken after
    it is undone by the load, and the next equals one process's second step."""
    two = request.getfixturevalue(ranks)
    one = GRPOTrainer(model_path, TrainConfig(**SETTINGS), seed=0)
    expected = one.step(mixed_batch(tok))
    got = two.step(mixed_batch(tok))
    two.save_state(tmp_path / "ckpt")  # rank 0 writes it
    assert not (tmp_path / "ckpt.tmp").exists()
    worst = _worst(one, tmp_path / "ckpt")
    print(f"largest adapter difference, 2 processes ({ranks}) vs 1:", worst)
    assert worst <= 1e-6, worst
    # Sharded, the gradient norm is a sum over shards in another order: epoch 2's loss (a small sum of terms near 1,
    # after a step clipped by that norm) moves in its 7th digit.
    for key in ("loss", "grad_norm", "kl", "clip_frac", "entropy", "logprob_gap", "num_transitions", "num_tokens"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6, nan_ok=True), key
    assert got["step"] == expected["step"] == 1.0
    ours = torch.load(tmp_path / "ckpt" / "optimizer.pt")["state"]
    theirs = one.optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys() and all(
        (ours[i][k] - theirs[i][k]).abs().max() <= 1e-6 for i in theirs for k in ("exp_avg", "exp_avg_sq"))

    two.step(mixed_batch(tok)[:4])  # moves the adapter away from the checkpoint's
    two.load_state(tmp_path / "ckpt")  # every process loads the checkpoint rank 0 wrote
    expected = one.step(mixed_batch(tok))
    got = two.step(mixed_batch(tok))
    assert got["step"] == expected["step"] == 2.0
    two.save_state(tmp_path / "ckpt2")
    worst = _worst(one, tmp_path / "ckpt2")
    assert worst <= 1e-6, worst


def test_sharded_processes_each_hold_half_the_base(sharded, two):
    whole, halves = two.held_parameters(), sharded.held_parameters()
    total = whole[0]["total"]
    assert [h["held"] for h in whole] == [total, total] and all(h["total"] == total for h in halves)
    print("base parameters held by each sharded process:", [h["held"] for h in halves], "of", total)
    assert sum(h["held"] for h in halves) == total  # each parameter held once
    assert all(abs(h["held"] - total / 2) <= 0.01 * total for h in halves), halves


def test_a_killed_process_stops_the_next_update_with_one_line(two, tok):
    victim = two.pids[1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RunError) as e:
        two.step(mixed_batch(tok))
    assert time.monotonic() - t0 < 30
    line = str(e.value)
    assert "\n" not in line
    assert f"trainer process 1 of 2 (pid {victim}) was killed by SIGKILL" in line and "--resume" in line
    assert all(p is None for p in [*two._procs]) or not two._procs  # every process stopped, none left waiting


def _ranks_of(pid: int) -> list[int]:
    """The trainer processes `lightning run` (pid) spawned: its children that run multiprocessing's spawn_main."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                    and b"spawn_main" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def test_a_two_process_run_a_killed_process_and_its_resume(tmp_path):
    """`lightning run` with train.processes = 2: a trainer process killed during iteration 2 ends the run with one
    line (no hang); `--resume` continues from iteration 1's checkpoint, which rank 0 wrote, to the end."""
    project = arith_project(tmp_path)
    toml = (project / "lightning.toml").read_text().replace('eval = "eval.jsonl"\n', "")
    (project / "lightning.toml").write_text(toml.replace("micro_batch_size = 8", "micro_batch_size = 4\nprocesses = 2"))
    run, log = project / "run", tmp_path / "first.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run"], cwd=project, env=env, text=True,
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not (run / "checkpoints" / "iter-00001").exists():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "no first checkpoint in 300 s"
                time.sleep(0.03)
            ranks = _ranks_of(proc.pid)
            assert len(ranks) == 2, ranks
            os.kill(ranks[1], signal.SIGKILL)
            code = proc.wait(timeout=120)  # the bound: a rank waiting on a dead peer would hang here
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code != 0, text
    lines = [line for line in text.splitlines() if f"(pid {ranks[1]}) was killed by SIGKILL" in line]
    assert len(lines) == 1 and "of 2" in lines[0] and "--resume" in lines[0], text
    assert sorted(p.name for p in (run / "checkpoints").glob("iter-*")) == ["iter-00001"]
    assert not _ranks_of(proc.pid)

    resumed = lightning("run", "--resume", cwd=project, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "after iteration 1" in resumed.stdout
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["train/step"] for r in rows if "train/step" in r]
    assert steps == [1.0, 2.0], steps  # each update once, the resumed one continuing the step count
    assert (run / "checkpoints" / "iter-00002" / "trainer" / "adapter" / "adapter_model.safetensors").is_file()


def test_processes_is_validated_once_in_the_config():
    assert TrainConfig().processes == 1  # the single-process path, in the run's own process
    for bad, words in (({"processes": 0}, "greater than or equal to 1"),
                       ({"processes": 2, "device": "cuda:1"}, "train.device = 'cuda:1' cannot name one"),
                       ({"shard": "fsdp"}, r"train.shard = 'fsdp' .* expected train.processes >= 2 \(it is 1\)"),
                       ({"processes": 2, "shard": "zero3"}, "'none' or 'fsdp'")):
        with pytest.raises(ValueError, match=words):
            TrainConfig(**bad)


def test_a_sharded_4bit_base_is_refused_with_one_line(tmp_path):
    """QLoRA under FSDP needs bitsandbytes' bnb_4bit_quant_storage, untestable without a GPU: refused, exit 2."""
    project = arith_project(tmp_path)
    toml = (project / "lightning.toml").read_text()
    (project / "lightning.toml").write_text(toml.replace("[train]\n", "[train]\nprocesses = 2\nshard = \"fsdp\"\n")
                                            .replace("[model]\n", "[model]\nquantization = \"4bit\"\n"))
    out = lightning("run", cwd=project, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "train.shard" in line]
    assert len(lines) == 1 and "model.quantization = '4bit'" in lines[0], out.stdout + out.stderr
    assert not (project / "run").exists()
