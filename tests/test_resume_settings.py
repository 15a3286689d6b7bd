"""--resume under changed settings (issue 24, item 6): a key that changes what the adapter means is refused
(one line naming it, exit 2, nothing written); train.lr and train.weight_decay are a logged override, the new
value applies. Real trainer checkpoints of the builtin tiny model."""

from __future__ import annotations

import logging

import pytest
import torch
from click.testing import CliRunner

from lightning_sdk import cli, config
from lightning_sdk.config import TrainConfig
from lightning_sdk.train.checkpoint import RunState, write_checkpoint
from lightning_sdk.train.trainer import GRPOTrainer, checkpoint_conflict
from tests.test_bad_input import GOOD_ROWS
from tests.test_bad_input import config as toml
from tests.test_trainer import mixed_batch

torch.set_num_threads(1)  # the machine is shared


@pytest.mark.parametrize("key, value", [("lora_alpha", 64), ("lora_r", 4), ("target_modules", ["q_proj"])])
def test_resume_refuses_a_changed_adapter_setting_and_writes_nothing(tmp_path, model_path, tok, key, value):
    (tmp_path / "train.jsonl").write_text(GOOD_ROWS)
    (tmp_path / "lightning.toml").write_text(toml())
    cfg = config.load(tmp_path / "lightning.toml")  # the tiny model's defaults: lora_alpha 16, lora_r 8
    tr = GRPOTrainer(model_path, cfg.train)
    tr.step(mixed_batch(tok))
    write_checkpoint(tmp_path / "run", 1, tr, RunState(completed=1, adapter_name="run-iter1"))
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    changed = f"{key} = {value!r}".replace("'", '"')
    (tmp_path / "lightning.toml").write_text(toml(train=changed))
    out = CliRunner().invoke(cli.main, ["run", "--resume", "-c", str(tmp_path / "lightning.toml")])
    assert out.exit_code == 2 and out.output.startswith(f"error: train.{key} = "), out.output
    assert "iter-00001 was trained with" in out.output and out.output.strip().count("\n") == 0, out.output
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.name != ".lock"}
    assert after == before  # no store, no metrics, the checkpoint as it was


def test_resume_applies_a_changed_lr_and_weight_decay_and_says_so(tmp_path, model_path, tok, caplog):
    a = GRPOTrainer(model_path, TrainConfig(device="cpu", lr=1e-2))
    a.step(mixed_batch(tok))
    a.save_state(tmp_path / "ckpt")
    assert checkpoint_conflict(tmp_path / "ckpt", TrainConfig(device="cpu", lr=1e-3, weight_decay=0.1)) is None
    b = GRPOTrainer(model_path, TrainConfig(device="cpu", lr=1e-3, weight_decay=0.1))
    with caplog.at_level(logging.WARNING, logger="lightning_sdk"):
        b.load_state(tmp_path / "ckpt")
    assert "resume: train.lr = 0.001 applies from here (the checkpoint's was 0.01)" in caplog.text
    assert "resume: train.weight_decay = 0.1 applies from here (the checkpoint's was 0)" in caplog.text
    m = b.step(mixed_batch(tok))
    assert m["lr"] == b.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert b.optimizer.param_groups[0]["weight_decay"] == 0.1
