"""No non-finite number is trained on, saved or served: config floats, rewards, advantages, gradients, adapters
(issue 24, item 4). Real steps on the builtin tiny model, a real server engine."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lightning_sdk import agent, cli, config
from lightning_sdk.config import TrainConfig
from lightning_sdk.errors import RunError
from lightning_sdk.train.grpo import group_advantages
from lightning_sdk.train.trainer import GRPOTrainer
from tests.test_trainer import mixed_batch

torch.set_num_threads(1)  # the machine is shared
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key, value, message", [
    ("rollout", "error_reward = nan", "rollout.error_reward: Input should be a finite number"),
    ("rollout", "failed_reward = -inf", "rollout.failed_reward: Input should be a finite number"),
    ("train", "lr = nan", "train.lr: Input should be a finite number"),
    ("train", "clip_eps = inf", "train.clip_eps: Input should be a finite number"),
    ("rollout", "failed_reward = 1e300", "rollout.failed_reward: Input should be less than or equal to 1000000"),
])
def test_a_nonfinite_setting_is_one_line_exit_2_and_writes_nothing(tmp_path, key, value, message):
    (tmp_path / "train.jsonl").write_text('{"question": "What is 1 + 2?", "answer": "3"}\n')
    (tmp_path / "lightning.toml").write_text(f'[run]\ndir = "run"\n[agent]\nmodule = "{ROOT}/cookbook/arith/agent.py"\n'
                                            f'[data]\ntrain = "train.jsonl"\n[{key}]\n{value}\n')
    out = CliRunner().invoke(cli.main, ["run", "-c", str(tmp_path / "lightning.toml")])
    assert out.exit_code == 2 and out.output.startswith("error: ") and message in out.output, out.output
    assert out.output.strip().count("\n") == 0 and not (tmp_path / "run").exists()


def test_the_config_and_the_agent_bound_rewards_alike():
    assert config.MAX_ABS_REWARD == agent.MAX_ABS_REWARD


@pytest.mark.parametrize("reward", [1e7, -1.7e308, 1e155])
def test_a_reward_beyond_the_bound_fails_with_one_line_naming_it(reward):
    with pytest.raises(agent.RewardError, match=rf"@reward returned {re.escape(repr(reward))} \(float\) for rollout r1; expected a "
                                                r"reward within \+-1e\+06"):
        agent.reward_value(reward, "@reward returned", " for rollout r1")
    assert agent.reward_value(-1e6, "@reward returned") == -1e6


def test_group_advantages_refuses_nonfinite_inputs_and_an_overflowing_std():
    ids = (["g", "g"], ["a", "b"])
    with pytest.raises(ValueError, match=r"outcomes\[1\] = nan \(rollout b\) is not finite"):
        group_advantages([1.0, math.nan], *ids)
    with pytest.raises(ValueError, match=r"shaping\[0\] = inf"):
        group_advantages([1.0, 0.0], *ids, shaping=[math.inf, 0.0])
    with pytest.raises(ValueError, match="std overflows"):  # 1e155 squared overflows: every advantage would be 0
        group_advantages([1e155, 0.0], *ids)
    assert group_advantages([1e6, -1e6], *ids).tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)


def test_the_reward_plot_survives_a_reward_matplotlib_cannot_draw(tmp_path):
    from lightning_sdk.metrics import MetricsLog

    m = MetricsLog(tmp_path, report_to=[], name="x", config={})
    out = m.plot([{"iteration": 1, "rollout/reward_mean": 1.7e308}, {"iteration": 2, "rollout/reward_mean": math.nan},
                  {"iteration": 3, "rollout/reward_mean": 0.5}], baseline=-1.7e308, final=0.75)
    assert out.stat().st_size > 0


def test_a_step_with_a_nonfinite_gradient_is_skipped_and_counted(model_path, tok):
    # lr 1e30: the first step is finite but throws the weights so far that the next forward overflows.
    tr = GRPOTrainer(model_path, TrainConfig(device="cpu", lr=1e30), seed=0)
    first = tr.step(mixed_batch(tok))
    assert first["skipped_steps"] == 0 and math.isfinite(first["grad_norm"])
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    second = tr.step(mixed_batch(tok))
    assert second["skipped_steps"] == 1 and math.isnan(second["grad_norm"])
    for n, p in tr.model.named_parameters():  # nothing moved, nothing became nan (Adam's moments neither)
        if p.requires_grad:
            assert torch.equal(p, before[n]), n
    assert all(bool(torch.isfinite(v).all()) for s in tr.optimizer.state.values() for v in s.values())


def test_an_adapter_holding_nan_is_never_saved_nor_served(model_path, tok, tmp_path):
    from lightning_sdk.engine.engine import Engine
    from lightning_sdk.engine.requests import RequestError
    from safetensors.torch import load_file, save_file

    tr = GRPOTrainer(model_path, TrainConfig(device="cpu"), seed=0)
    tr.step(mixed_batch(tok))
    tr.save_adapter(tmp_path / "good")
    with torch.no_grad():
        tr.params[0][0, 0] = math.nan
    with pytest.raises(RunError, match=r"holds nan or inf \(first in .*lora_.*\); it is not saved, served or "
                                       r"published"):
        tr.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and [p.name for p in tmp_path.iterdir()] == ["good"]

    weights = load_file(tmp_path / "good/adapter_model.safetensors")
    name = next(iter(weights))
    weights[name][0, 0] = math.inf
    save_file(weights, tmp_path / "good/adapter_model.safetensors")  # an adapter made elsewhere, say
    engine = Engine(model_path, dtype="float32", max_batch_size=4, max_model_len=256)
    try:
        with pytest.raises(RequestError, match=f"tensor {name} holds nan or inf"):
            asyncio.run(engine.load_adapter("bad", str(tmp_path / "good")))
        assert engine.adapters == []
    finally:
        engine.close()
