"""The loss's safeguards are on by default: dual clip (verl's clip_ratio_c), importance sampling against vLLM
(TRL's vllm_importance_sampling_cap), a bounded k3 KL term (verl's low_var_kl); GSPO's sequence-level ratio on
request. The math by hand, the defaults through the config a user writes, and a real step on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_sdk import config, models
from lightning_sdk.config import TrainConfig
from lightning_sdk.servers.select import resolved_backend
from lightning_sdk.train.grpo import KL_LOG_RATIO_CLAMP, grpo_loss
from lightning_sdk.train.trainer import GRPOTrainer
from lightning_sdk.transitions import Transition

torch.set_num_threads(1)


def parse(train: dict | None = None, **serve) -> config.Config:
    return config.parse({"agent": {"module": "agent.py"}, "data": {"train": "tasks.jsonl"},
                         "model": {"name": "my-model"}, "serve": serve, "train": train or {}})


def test_dual_clip_is_on_by_default_and_off_can_be_written():
    assert parse().train.dual_clip == 3.0
    assert parse({"dual_clip": "off"}).train.dual_clip is None
    assert parse({"dual_clip": 2.5}).train.dual_clip == 2.5
    with pytest.raises(config.ConfigError, match="train.dual_clip"):
        parse({"dual_clip": "sometimes"})


def test_importance_sampling_is_on_with_vllm_and_off_on_the_built_in_server():
    vllm, cpu, auto = parse(backend="vllm"), parse(backend="cpu"), parse(backend="auto")
    assert resolved_backend(vllm) == "vllm" and resolved_backend(cpu) == "cpu"
    assert resolved_backend(auto) == "cpu"  # this machine has no vllm (or no GPU): 'auto' starts the CPU server
    assert vllm.train.importance_sampling_cap == "auto"
    assert vllm.train.sampling_cap(resolved_backend(vllm)) == 2.0
    assert cpu.train.sampling_cap(resolved_backend(cpu)) is None
    assert parse({"importance_sampling_cap": 3}).train.sampling_cap("cpu") == 3.0  # a number: always
    assert parse({"importance_sampling_cap": "off"}, backend="vllm").train.sampling_cap("vllm") is None
    with pytest.raises(config.ConfigError, match="train.importance_sampling_cap"):
        parse({"importance_sampling_cap": 0.5})


def test_the_k3_kl_term_is_finite():
    # a token 100 nats more likely under the reference: unclamped, exp(100) overflows float32 and the loss is inf.
    # The log-ratio is clamped at KL_LOG_RATIO_CLAMP (20); the value itself is not (TRL; docs/credit.md).
    logp = torch.tensor([-101.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    loss, st = grpo_loss(logp, logp.detach(), torch.zeros(2), torch.tensor([0.5, 0.5]), clip_eps=0.2,
                         ref_logp=ref, beta=1.0)
    assert KL_LOG_RATIO_CLAMP == 20.0
    k3 = math.exp(20.0) - 20.0 - 1.0
    assert st["kl"].item() == pytest.approx(0.5 * k3, rel=1e-5) and loss.item() == pytest.approx(0.5 * k3, rel=1e-5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    # within the bound the term is the plain k3: ref - logp = ln 2
    logp = torch.tensor([-1.0]).requires_grad_()
    _, st = grpo_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1), clip_eps=0.2,
                      ref_logp=torch.tensor([-1.0 + math.log(2.0)]), beta=1.0)
    assert st["kl"].item() == pytest.approx(2.0 - math.log(2.0) - 1.0)


def test_gspo_uses_one_ratio_per_sequence_by_hand():
    # row 0: log-ratios 0.3 and -0.1 (mean 0.1); row 1: one real token at 0.5, then padding (weight 0, log-ratio 9)
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.3, -0.1], [0.5, 9.0]], requires_grad=True)
    adv = torch.tensor([[1.0], [-1.0]])
    w = torch.tensor([[0.25, 0.25], [0.5, 0.0]])
    loss, st = grpo_loss(logp, old, adv, w, clip_eps=0.2, level="sequence")
    s0, s1 = math.exp(0.1), math.exp(0.5)  # row 1: 1.65 > 1.2 with A < 0: not clipped (the PPO min)
    assert st["ratio"].item() == pytest.approx(0.5 * s0 + 0.5 * s1)
    assert loss.item() == pytest.approx(0.5 * -s0 + 0.5 * s1)
    loss.backward()
    # d/dlogp_t of -A * exp(mean log-ratio) * sum(w) = -A * s * sum(w) / tokens of the row, for its real tokens only
    assert torch.allclose(logp.grad, torch.tensor([[-s0 * 0.5 / 2, -s0 * 0.5 / 2], [s1 * 0.5, 0.0]]), atol=1e-6)
    # per token (the default), row 0's first token alone (ratio 1.35 > 1.2, A > 0) would have been clipped
    _, st = grpo_loss(logp.detach(), old, adv, w, clip_eps=0.2)
    assert st["clip_frac"].item() == pytest.approx(0.25)
    _, st = grpo_loss(logp.detach(), old, adv, w, clip_eps=0.2, level="sequence")
    assert st["clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="level"):
        grpo_loss(logp, old, adv, w, clip_eps=0.2, level="episode")


def test_a_trainer_for_a_vllm_run_corrects_towards_its_sampler():
    path = models.resolve("builtin:tiny-arith")
    tok = models.load_tokenizer(path)
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
    ts = [Transition(f"r{i}", "g", f"s{i}", 0, None, prompt, tuple(tok(text)["input_ids"]),
                     tuple([-0.5] * len(tok(text)["input_ids"])), float(i == 0))
          for i, text in enumerate(["4", "5", "six"])]
    cfg = TrainConfig(device="cpu", lora_r=4)
    sampled_by_vllm = GRPOTrainer(path, cfg, backend="vllm", seed=0).step(ts)
    sampled_here = GRPOTrainer(path, cfg, seed=0).step(ts)
    assert 0 < sampled_by_vllm["is_weight"] <= 2.0  # the sampler's log-probs (-0.5) are not the trainer's
    assert "is_weight" not in sampled_here
    gspo = GRPOTrainer(path, TrainConfig(device="cpu", lora_r=4, importance_sampling_level="sequence"), seed=0)
    m = gspo.step(ts)
    assert m["ratio"] == pytest.approx(1.0) and m["grad_norm"] > 0
