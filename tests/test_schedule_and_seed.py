"""Edges of the update loop (issue 24, item 9): the learning-rate schedule keeps its place through updates with
nothing to train and checkpoints without scheduler.pt; the server's random stream follows run.seed and resume;
dropout with several epochs is said out loud. Real steps on the builtin tiny model."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_sdk import config
from lightning_sdk.config import TrainConfig
from lightning_sdk.servers.select import make_server
from lightning_sdk.train.checkpoint import RunState, write_checkpoint
from lightning_sdk.train.trainer import GRPOTrainer
from tests.test_trainer import mixed_batch

torch.set_num_threads(1)  # the machine is shared


def test_an_update_with_nothing_to_train_still_moves_the_schedule_on(model_path, tok):
    tr = GRPOTrainer(model_path, TrainConfig(device="cpu", lr=1e-2, lr_schedule="linear"), total_steps=2)
    solo = [t for t in mixed_batch(tok) if t.group_id == "solo"]  # one rollout: no baseline, nothing to train
    assert tr.step(solo)["num_transitions"] == 0
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)  # half the linear decay: 1 of 2 steps
    tr.step(mixed_batch(tok))
    assert tr.optimizer.param_groups[0]["lr"] == 0.0  # the schedule ends with the run


def test_a_checkpoint_without_scheduler_state_resumes_after_warmup_not_at_its_start(model_path, tok, tmp_path):
    c = TrainConfig(device="cpu", lr=1e-2, warmup_steps=4, epochs=2)
    a = GRPOTrainer(model_path, c)
    a.step(mixed_batch(tok))
    a.save_state(tmp_path / "ckpt")
    (tmp_path / "ckpt/scheduler.pt").unlink()
    b = GRPOTrainer(model_path, c)
    b.load_state(tmp_path / "ckpt")
    a.step(mixed_batch(tok))
    b.step(mixed_batch(tok))
    # 2 updates x 2 epochs: warmup done. Restarted warmup would stand at 2 of 4 steps.
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_the_server_seed_follows_run_seed_and_each_resume(tmp_path, model_path):
    def seed(run_seed: int) -> str:
        cfg = config.parse({"run": {"dir": str(tmp_path / "run"), "seed": run_seed}, "agent": {"module": "a.py"},
                            "data": {"train": "t.jsonl"}})
        cmd = make_server(cfg, model_path, tmp_path / "server.log").command()
        return cmd[cmd.index("--seed") + 1]

    first, other = seed(0), seed(1)
    write_checkpoint(tmp_path / "run", 1, _NoTrainer(), RunState(completed=1))
    resumed = seed(0)
    assert len({first, other, resumed}) == 3
    write_checkpoint(tmp_path / "run", 2, _NoTrainer(), RunState(completed=2))
    assert seed(0) not in {first, resumed}


class _NoTrainer:  # write_checkpoint's trainer: only its files matter here
    def save_state(self, path):
        path.mkdir()


def test_dropout_with_several_epochs_is_warned_about(model_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_sdk"):
        GRPOTrainer(model_path, TrainConfig(device="cpu", lora_dropout=0.1, epochs=1))
        assert not caplog.records
        GRPOTrainer(model_path, TrainConfig(device="cpu", lora_dropout=0.1, epochs=2))
    assert "train.lora_dropout = 0.1 (or the model's own dropout) with train.epochs = 2" in caplog.text
