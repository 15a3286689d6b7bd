"""GRPO trainer: the math on hand-computed tensors, then real steps on the builtin tiny model (no mocks)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from lightning_sdk import models
from lightning_sdk.config import TrainConfig
from lightning_sdk.files import atomic_dir as _atomic_dir
from lightning_sdk.files import load_py_file
from lightning_sdk.train.grpo import (entropy, group_advantages, grpo_loss, sampler_is_weight, token_weights,
                                     top_p_keep, zero_variance_groups)
from lightning_sdk.train.trainer import GRPOTrainer, lora_targets, resolve_device
from lightning_sdk.transitions import Transition

torch.set_num_threads(1)  # the CI machine is small and shared
arith = load_py_file(Path(__file__).parents[1] / "cookbook" / "arith" / "teacher.py")  # builtin:tiny-arith's teacher


# ---------------------------------------------------------------------------------------------- advantages


def test_advantages_weigh_rollouts_not_calls():
    # rollout a: 1 call, reward 1; rollout b: 3 calls, reward 0 each. Per-call mean would be 0.25; per-rollout 0.5.
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], ["g"] * 4, ["a", "b", "b", "b"], scale="none")
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, -0.5]))
    # weighted var = 1/2*0.25 + 3*(1/6)*0.25 = 0.25, Bessel over 2 rollouts -> 0.5, std = sqrt(0.5)
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], ["g"] * 4, ["a", "b", "b", "b"], scale="group")
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, -0.5]) / (math.sqrt(0.5) + 1e-4))


def test_advantages_shaping_moves_one_call_within_the_failure_bound():
    # rollouts c (two calls, the second shaped +0.25 and the first -0.25), d, e; outcomes 1, 0, 0.
    # Outcomes [1, 0, 0]: mean 1/3, std sqrt(1/3); "none": A_c = 2/3, A_d = A_e = -1/3, divisor 1.
    # c's bounds: its outcome -> worst (0): A = 0, so shaping may lower it by 2/3; -> best (1): unchanged, so +0.
    adv = group_advantages([1.0, 1.0, 0.0, 0.0], ["h"] * 4, ["c", "c", "d", "e"], scale="none",
                           shaping=[-0.25, 0.25, 0.0, 0.0])
    assert torch.allclose(adv, torch.tensor([2 / 3 - 0.25, 2 / 3, -1 / 3, -1 / 3]))
    adv = group_advantages([1.0, 1.0, 0.0, 0.0], ["h"] * 4, ["c", "c", "d", "e"], scale="none",
                           shaping=[-5.0, 0.0, 0.0, 0.0], credit=[0.5, 1.0, 1.0, 1.0])
    assert torch.allclose(adv, torch.tensor([0.5 * 2 / 3 - 2 / 3, 2 / 3, -1 / 3, -1 / 3]))
    with pytest.raises(ValueError, match="different episode rewards"):
        group_advantages([1.0, 2.0], ["h"] * 2, ["c", "c"])


def test_advantages_scaled_per_batch_or_not_at_all():
    # groups x: outcomes [1, 0], y: [3, 1]; centred per group: [.5, -.5, 1, -1]
    r, g, ids = [1.0, 0.0, 3.0, 1.0], ["x", "x", "y", "y"], ["1", "2", "3", "4"]
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0])
    assert torch.allclose(group_advantages(r, g, ids, "none"), centred)
    batch_std = torch.tensor(r).std().item()  # std over the whole batch (TRL scale_rewards="batch")
    assert torch.allclose(group_advantages(r, g, ids, "batch"), centred / (batch_std + 1e-4))
    assert torch.allclose(group_advantages(r, g, ids, "group"),
                          centred / torch.tensor([0.5 ** 0.5, 0.5 ** 0.5, 2 ** 0.5, 2 ** 0.5]).add(1e-4))


def test_advantages_match_trl_for_one_call_rollouts_and_groups_are_independent():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    adv = group_advantages(r, ["x"] * 4 + ["y"] * 2, ["1", "2", "3", "4", "5", "6"])
    x, y = r[:4], r[4:]
    assert torch.allclose(adv[:4], (x - x.mean()) / (x.std() + 1e-4))  # TRL: unbiased std + 1e-4
    assert torch.allclose(adv[4:], (y - y.mean()) / (y.std() + 1e-4))


def test_advantages_zero_without_signal():
    # equal rewards (an awkward float, so a float mean would not cancel exactly) and a single-rollout group
    adv = group_advantages([0.1] * 3 + [1.0, 1.0], ["g"] * 3 + ["solo"] * 2, ["a", "b", "c", "s", "s"],
                           shaping=[0.5, 0.0, 0.0, 0.0, 2.0])  # shaping alone makes no signal
    assert torch.equal(adv, torch.zeros(5))
    with pytest.raises(ValueError, match="scale"):
        group_advantages([1.0], ["g"], ["a"], scale="mean")
    assert zero_variance_groups([0.1] * 3 + [1.0, 1.0, 2.0], ["g"] * 3 + ["solo"] * 2 + ["one"],
                                ["a", "b", "c", "s", "s", "o"]) == {"g"}


# -------------------------------------------------------------------------------------------- token weights

# rollout A: two calls of 2 and 6 tokens; rollout B: one call of 4 tokens; plus an empty completion in B
N_TOK, RIDS = [2, 6, 4, 0], ["A", "A", "B", "B"]


def test_token_weights_rollout_norm():
    w = token_weights(N_TOK, RIDS, "rollout")
    assert torch.allclose(w, torch.tensor([1 / 16, 1 / 16, 1 / 8, 0.0]))
    per_rollout = [(w[:2] * torch.tensor([2.0, 6.0])).sum(), w[2] * 4]
    assert torch.allclose(torch.stack(per_rollout), torch.tensor([0.5, 0.5]))  # 8 tokens vs 4: same say


def test_token_weights_token_and_sequence_norms():
    assert torch.allclose(token_weights(N_TOK, RIDS, "token"), torch.tensor([1 / 12, 1 / 12, 1 / 12, 0.0]))
    assert torch.allclose(token_weights(N_TOK, RIDS, "sequence"), torch.tensor([1 / 6, 1 / 18, 1 / 12, 0.0]))
    w = token_weights(N_TOK, RIDS, "token")
    assert (w[:2] * torch.tensor([2.0, 6.0])).sum() == pytest.approx(8 / 12)  # "token" lets the long rollout lead


@pytest.mark.parametrize("norm", ["rollout", "token", "sequence"])
def test_token_weights_sum_to_one(norm):
    w = token_weights(N_TOK, RIDS, norm)
    assert (w * torch.tensor(N_TOK, dtype=torch.float)).sum() == pytest.approx(1.0)


def test_token_weights_constant_and_bnpo():
    # Dr.GRPO: 4 transitions x L = 8 -> every token 1/32, whatever the lengths; the one without tokens counts in
    # the normaliser as in TRL (per_token_loss.size(0) * max_completion_length)
    w = token_weights(N_TOK, RIDS, "constant", max_completion_length=8)
    assert torch.allclose(w, torch.tensor([1 / 32, 1 / 32, 1 / 32, 0.0]))
    # two of four calls masked as truncated: the others' tokens weigh as much as with none masked
    assert torch.allclose(token_weights([3, 0, 5, 0], ["a", "b", "c", "d"], "constant", max_completion_length=8),
                          torch.tensor([1 / 32, 0.0, 1 / 32, 0.0]))
    # bnpo: group x holds 2 + 6 tokens, group y 4: the token mean of each group, then the mean over the 2 groups
    w = token_weights(N_TOK, RIDS, "bnpo", group_ids=["x", "x", "y", "y"])
    assert torch.allclose(w, torch.tensor([1 / 16, 1 / 16, 1 / 8, 0.0]))
    # within a group every token weighs the same, short completion or long: no length bias inside a group
    w = token_weights([1, 9, 5, 5], ["a", "b", "c", "d"], "bnpo", group_ids=["x", "x", "y", "y"])
    assert torch.allclose(w, torch.tensor([1 / 20] * 4))
    with pytest.raises(ValueError, match="group"):
        token_weights(N_TOK, RIDS, "bnpo")
    with pytest.raises(ValueError, match="max_completion_length"):
        token_weights(N_TOK, RIDS, "constant")


def test_token_weights_reject_bad_input():
    with pytest.raises(ValueError, match="loss_norm"):
        token_weights([1], ["a"], "mean")
    with pytest.raises(ValueError, match="no completion tokens"):
        token_weights([0, 0], ["a", "b"], "rollout")


# ------------------------------------------------------------------------------------------------ grpo loss


def test_grpo_loss_clipping_by_hand():
    ratio = torch.tensor([1.1, 1.5, 0.5, 1.5])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])
    old = torch.full((4,), -2.0)
    logp = (old + ratio.log()).requires_grad_()
    loss, st = grpo_loss(logp, old, adv, w, clip_eps=0.2)
    # per token: -1.1 (inside), -1.2 (A>0, clipped at 1.2), +0.8 (A<0, clipped at 0.8), +1.5 (A<0, r>1: not clipped)
    assert loss.item() == pytest.approx(0.1 * -1.1 + 0.2 * -1.2 + 0.3 * 0.8 + 0.4 * 1.5)
    assert st["clip_frac"].item() == pytest.approx(0.2 + 0.3)
    assert st["ratio"].item() == pytest.approx(0.1 * 1.1 + 0.2 * 1.5 + 0.3 * 0.5 + 0.4 * 1.5)
    loss.backward()
    # d/dlogp of -r*A = -r*A: push up where A>0, down where A<0, nothing where clipped
    assert torch.allclose(logp.grad, torch.tensor([-0.1 * 1.1, 0.0, 0.0, 0.4 * 1.5]))
    # clip-higher: the 1.5 ratio with A>0 is now inside the region
    loss, st = grpo_loss(logp.detach(), old, adv, w, clip_eps=0.2, clip_eps_high=0.6)
    assert loss.item() == pytest.approx(0.1 * -1.1 + 0.2 * -1.5 + 0.3 * 0.8 + 0.4 * 1.5)
    assert st["clip_frac"].item() == pytest.approx(0.3)


def test_grpo_loss_log_ratio_clamp_keeps_gradients_finite():
    old = torch.zeros(2)
    logp = torch.tensor([100.0, 0.0], requires_grad=True)  # a log-ratio of 100: exp overflows float32
    adv, w = torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5])
    loss, _ = grpo_loss(logp, old, adv, w, clip_eps=0.2, log_ratio_clamp=None)
    loss.backward()
    assert torch.isnan(logp.grad[0])  # the defect: inf * 0 in exp's backward
    logp.grad = None
    loss, st = grpo_loss(logp, old, adv, w, clip_eps=0.2)  # default clamp 20: clipped at 1.2, no gradient
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * -1.2 + 0.5 * -1.0) and logp.grad.tolist() == [0.0, -0.5]


def test_grpo_loss_dual_clip_by_hand():
    ratio = torch.tensor([5.0, 2.0, 5.0])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    w = torch.tensor([0.2, 0.3, 0.5])
    old = torch.zeros(3)
    logp = ratio.log().requires_grad_()
    loss, st = grpo_loss(logp, old, adv, w, clip_eps=0.2, dual_clip=3.0)
    # token 0: A<0, loss r*|A| = 5 capped at 3*|A| = 3; token 1: 2 < 3 stays; token 2 (A>0): clipped at 1.2
    assert loss.item() == pytest.approx(0.2 * 3.0 + 0.3 * 2.0 + 0.5 * -1.2)
    assert st["dual_clip_frac"].item() == pytest.approx(0.2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, 0.3 * 2.0, 0.0]))


def test_top_p_nucleus_and_entropy_by_hand():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.15, 0.5, 0.05, 0.3], [0.15, 0.5, 0.05, 0.3]])
    # sorted 0.5, 0.3, 0.15, 0.05: mass before each 0, 0.5, 0.8, 0.95
    keep = top_p_keep(probs, torch.tensor([[0.7], [0.5], [1.0]]))
    assert keep.tolist() == [[False, True, False, True], [False, True, False, False], [True] * 4]
    logits = probs.log().masked_fill(~keep, -math.inf)
    assert torch.allclose(torch.log_softmax(logits, -1)[0, [1, 3]], torch.tensor([0.5, 0.3]).div(0.8).log())
    ent = entropy(logits)
    assert ent[1].item() == 0.0 and ent[0].item() == pytest.approx(-(0.625 * math.log(0.625) + 0.375 * math.log(0.375)))
    assert entropy(torch.zeros(2)).item() == pytest.approx(math.log(2))


def test_lr_warmup_and_schedule_by_hand():
    from lightning_sdk.train.trainer import _lr_scheduler

    def lrs(schedule, total):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = _lr_scheduler(opt, cfg(lr=1.0, warmup_steps=2, lr_schedule=schedule), total)
        out = []
        for _ in range(5):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    assert lrs("constant", None) == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])
    assert lrs("linear", 4) == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])
    assert lrs("cosine", 4) == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])  # cos over 2 steps: 1, 0.5, 0
    with pytest.raises(ValueError, match="total optimizer steps"):
        lrs("linear", None)


def test_grpo_loss_k3_kl():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.0 + math.log(2.0), -2.0])  # token 0: ref - logp = ln 2; token 1: equal
    loss, st = grpo_loss(logp, logp.detach(), torch.zeros(2), torch.tensor([1.0, 0.0]), clip_eps=0.2,
                         ref_logp=ref, beta=0.5)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert st["kl"].item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.5 * k3)
    loss.backward()
    # d/dlogp = beta * (1 - exp(ref - logp)) = 0.5 * (1 - 2) < 0: descent raises logp towards the reference
    assert logp.grad[0].item() == pytest.approx(-0.5)
    # the KL is zero where the policy equals the reference
    _, st = grpo_loss(logp.detach(), logp.detach(), torch.zeros(2), torch.tensor([0.0, 1.0]), clip_eps=0.2,
                      ref_logp=ref, beta=0.5)
    assert st["kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_sampler_importance_weights_by_hand():
    old = torch.tensor([-1.0, -2.0, -1.0, -1.0])
    sampler = torch.tensor([-1.5, -1.0, -3.0, -1.0])
    has = torch.tensor([True, True, True, False])
    w = sampler_is_weight(old, sampler, has, cap=2.0)
    # exp(0.5) = 1.649 kept; exp(-1) = 0.368 kept (truncation caps only from above); exp(2) = 7.39 capped at 2;
    # no sampler log-prob: weight 1
    assert torch.allclose(w, torch.tensor([math.exp(0.5), math.exp(-1.0), 2.0, 1.0]))


def test_grpo_loss_importance_weight_scales_the_policy_term_not_the_kl():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.0 + math.log(2.0), -2.0])
    adv = torch.tensor([1.0, -1.0])
    w = torch.tensor([0.5, 0.5])
    is_w = torch.tensor([2.0, 0.25])
    loss, st = grpo_loss(logp, logp.detach(), adv, w, clip_eps=0.2, ref_logp=ref, beta=0.5, is_weight=is_w)
    k3 = 2.0 - math.log(2.0) - 1.0
    # ratio 1: policy term -A per token, times its weight; the KL (token 0 only) unweighted
    assert loss.item() == pytest.approx(0.5 * (-1.0 * 2.0 + 0.5 * k3) + 0.5 * (1.0 * 0.25))
    assert st["is_weight"].item() == pytest.approx(0.5 * 2.0 + 0.5 * 0.25)
    loss.backward()
    # d/dlogp: -A * is_w * w (+ the KL's beta * (1 - 2) * w on token 0)
    assert torch.allclose(logp.grad, torch.tensor([0.5 * (-2.0 - 0.5), 0.5 * 0.25]))


# ------------------------------------------------------------------------------------- real model: helpers


def prompt_ids(tok, a: int, b: int) -> tuple[int, ...]:
    msgs = [{"role": "user", "content": arith.question(a, b)}]
    return tuple(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])


def answer_ids(tok, text: str) -> tuple[int, ...]:
    return tuple(tok(text)["input_ids"]) + (tok.eos_token_id,)


def mixed_batch(tok) -> list[Transition]:
    """Two groups, unequal prompt and completion lengths, a two-call rollout, one single-rollout group."""
    def t(rid, gid, idx, a, b, text, reward, temp=1.0, **kw):
        return Transition(rid, gid, f"{rid}.{idx}", idx, None, prompt_ids(tok, a, b), answer_ids(tok, text), None,
                          reward, temp, **kw)
    return [
        t("r1", "g1", 0, 3, 4, "7", 1.0), t("r2", "g1", 0, 3, 4, "8", 0.0),
        t("r3", "g1", 0, 3, 4, "a longer wrong reply", 0.0, 0.7),
        t("r4", "g2", 0, 9, 9, "18", 1.0), t("r4", "g2", 1, 9, 9, "18 again", 1.5, episode_reward=1.0, shaping=0.5), t("r5", "g2", 0, 9, 9, "17", 0.0),
        t("r6", "solo", 0, 1, 1, "2", 1.0),
    ]


def snapshot(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def cfg(**kw) -> TrainConfig:
    return TrainConfig(device="cpu", **kw)


# ------------------------------------------------------------------------------------------ real model steps


@pytest.mark.parametrize("norm", ["rollout", "token", "sequence", "constant", "bnpo"])
def test_gradient_accumulation_is_exact(model_path, tok, norm):
    # SGD(lr=1) with no clipping makes the parameter change exactly -grad, so we compare gradients through step().
    deltas, metrics = [], []
    for mbs in (1, 7):
        tr = GRPOTrainer(model_path, cfg(micro_batch_size=mbs, loss_norm=norm, max_grad_norm=1e9, max_completion_length=16,
                                         target_modules=["all-linear", "lm_head"]), seed=0)
        tr.optimizer = torch.optim.SGD(tr.params, lr=1.0)
        before = snapshot(tr)
        metrics.append(tr.step(mixed_batch(tok)))
        deltas.append({n: p.detach() - before[n] for n, p in tr.model.named_parameters() if p.requires_grad})
    assert any(d.abs().max() > 0 for d in deltas[0].values())
    for n in deltas[0]:
        torch.testing.assert_close(deltas[0][n], deltas[1][n], rtol=1e-4, atol=1e-7)
    assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-4)
    assert metrics[0]["num_skipped"] == 1 and metrics[0]["num_transitions"] == 6


def test_gradient_checkpointing_gives_same_update(model_path, tok):
    deltas = []
    for ckpt in (False, True):
        tr = GRPOTrainer(model_path, cfg(gradient_checkpointing=ckpt, max_grad_norm=1e9), seed=0)
        tr.optimizer = torch.optim.SGD(tr.params, lr=1.0)
        before = snapshot(tr)
        tr.step(mixed_batch(tok))
        deltas.append(torch.cat([(p.detach() - before[n]).flatten()
                                 for n, p in tr.model.named_parameters() if p.requires_grad]))
    assert deltas[0].abs().max() > 0
    torch.testing.assert_close(deltas[0], deltas[1], rtol=1e-4, atol=1e-7)


def test_epoch_zero_log_probs_serve_as_the_old_policy(model_path, tok):
    # Without dropout, reusing epoch 0's log-probs as the old policy's must give the update a separate no-grad
    # pass gives (the clipped ratio in epoch 1 depends on them).
    deltas = []
    for reuse in (True, False):
        tr = GRPOTrainer(model_path, cfg(lr=0.5, epochs=3, clip_eps=0.05, max_grad_norm=1e9), seed=0)
        assert tr._train_forward_is_eval
        tr._train_forward_is_eval = reuse
        tr.optimizer = torch.optim.SGD(tr.params, lr=0.5)
        before = snapshot(tr)
        m = tr.step(mixed_batch(tok))
        deltas.append(torch.cat([(p.detach() - before[n]).flatten()
                                 for n, p in tr.model.named_parameters() if p.requires_grad]))
    assert m["clip_frac"] > 0  # later epochs did clip against the old log-probs
    torch.testing.assert_close(deltas[0], deltas[1], rtol=1e-4, atol=1e-7)


def test_step_trains_lora_only_and_saved_adapter_reproduces_logits(model_path, tok, tmp_path):
    from peft import PeftModel

    tr = GRPOTrainer(model_path, cfg(lr=1e-2, epochs=2, beta=0.04, target_modules=["all-linear", "lm_head"]))
    assert "lm_head" in tr.model.peft_config["default"].target_modules  # "all-linear" + extras expanded
    before = snapshot(tr)
    m = tr.step(mixed_batch(tok))
    for k in ("loss", "grad_norm", "kl", "clip_frac", "ratio", "adv_mean", "adv_std", "episode_reward_mean",
              "shaping_mean", "num_transitions", "num_tokens", "seconds", "logprob_gap", "entropy", "lr",
              "zero_variance_frac"):
        assert isinstance(m[k], float), k
    assert m["ratio"] != 1.0 and m["kl"] > 0  # epoch 2 sees a moved policy; the reference differs from it
    lora = [n for n in before if "lora_" in n]
    assert lora and all(not torch.equal(before[n], tr.model.get_parameter(n)) for n in lora if "lora_B" in n)
    assert all(torch.equal(before[n], tr.model.get_parameter(n)) for n in before if "lora_" not in n)

    tr.save_adapter(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    loaded = PeftModel.from_pretrained(models.load_causal_lm(model_path), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([prompt_ids(tok, 2, 5) + answer_ids(tok, "7")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, tr.model(input_ids=ids).logits)
        base = models.load_causal_lm(model_path)(input_ids=ids).logits
    assert not torch.allclose(base, tr.model(input_ids=ids).logits)


def test_state_round_trip_continues_identically(model_path, tok, tmp_path):
    c = cfg(lr=1e-2, lora_dropout=0.1)  # dropout draws random numbers: the RNG must be restored too
    a = GRPOTrainer(model_path, c, seed=0)
    batch = mixed_batch(tok)
    a.step(batch)
    a.save_state(tmp_path / "ckpt")
    a.save_state(tmp_path / "ckpt")  # overwriting a checkpoint works and leaves no temp dirs behind
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    ma = a.step(batch[::-1])

    b = GRPOTrainer(model_path, c, seed=123)  # a different LoRA init, all overwritten by the checkpoint
    b.load_state(tmp_path / "ckpt")
    assert b.global_step == 1
    mb = b.step(batch[::-1])
    assert mb["loss"] == ma["loss"] and mb["grad_norm"] == ma["grad_norm"] and mb["step"] == 2
    # identical dropout masks too: b restored the RNG a had when it saved (one process shares the global RNG)
    for n, p in a.model.named_parameters():
        assert torch.equal(p, b.model.get_parameter(n)), n


def test_interrupted_write_leaves_no_checkpoint(model_path, tmp_path):
    with pytest.raises(RuntimeError):
        with _atomic_dir(tmp_path / "ckpt") as tmp:
            (tmp / "adapter_model.safetensors").write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "partial").mkdir()
    tr = GRPOTrainer(model_path, cfg())
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        tr.load_state(tmp_path / "partial")


def test_empty_batch_and_single_rollout_groups(model_path, tok):
    tr = GRPOTrainer(model_path, cfg())
    with pytest.raises(ValueError, match="empty batch"):
        tr.step([])
    before = snapshot(tr)
    solo = [t for t in mixed_batch(tok) if t.group_id == "solo"]
    m = tr.step(solo)
    assert m["num_transitions"] == 0 and m["num_skipped"] == 1 and tr.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in tr.model.named_parameters())


def test_targets_and_device(model_path):
    base = models.load_causal_lm(model_path)
    assert lora_targets(base, "all-linear") == "all-linear"  # peft's own shorthand: every linear but the head
    assert lora_targets(base, ["q_proj"]) == ["q_proj"]
    expanded = lora_targets(base, ["all-linear", "lm_head"])
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"} == set(expanded)
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------------------------- learning


def learn_arithmetic(model_path: str, tok, *, seed: int = 0, steps: int = 60, problems: int = 8, group: int = 8,
                     **train) -> dict[str, float]:
    """GRPO on self-sampled completions (HF generate, T=1), reward = exact sum. Returns P(correct) before/after:
    the model's mean probability of the right answer over all 100 problems (exact, no sampling noise)."""
    tr = GRPOTrainer(model_path, cfg(**train), seed=seed)
    rng, eos = random.Random(seed), tok.eos_token_id

    @torch.no_grad()
    def p_correct() -> float:
        total = 0.0
        for a, b in arith.problems():
            ans = answer_ids(tok, str(a + b))
            logits = tr.model(input_ids=torch.tensor([prompt_ids(tok, a, b) + ans])).logits[0, -len(ans) - 1:-1]
            total += logits.log_softmax(-1).gather(-1, torch.tensor(ans)[:, None]).sum().exp().item()
        return total / len(arith.problems())

    @torch.no_grad()
    def sample(step: int, tasks: list[tuple[int, int]]) -> list[Transition]:
        enc = tok.pad([{"input_ids": list(prompt_ids(tok, a, b))} for a, b in tasks for _ in range(group)],
                      return_tensors="pt")
        out = tr.model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6,
                                pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
        L = enc["input_ids"].shape[1]
        logps = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, out.sequences[:, L:, None]).squeeze(-1)
        ts = []
        for j, row in enumerate(out.sequences[:, L:].tolist()):
            (a, b), n = tasks[j // group], (row.index(eos) + 1 if eos in row else len(row))
            reward = float(tok.decode(row[:n], skip_special_tokens=True).strip() == str(a + b))
            ids, keep = enc["input_ids"][j].tolist(), enc["attention_mask"][j].tolist()
            prompt = tuple(x for x, k in zip(ids, keep) if k)
            ts.append(Transition(f"{step}.{j}", f"{step}.{j // group}", f"{step}.{j}", 0, None, prompt,
                                 tuple(row[:n]), tuple(logps[j, :n].tolist()), reward))
        return ts

    before, train_s, gaps = p_correct(), 0.0, []
    for step in range(steps):
        m = tr.step(sample(step, [rng.choice(arith.problems()) for _ in range(problems)]))
        gaps.append(m["logprob_gap"])
        train_s += m["seconds"]
    return {"before": before, "after": p_correct(), "first_gap": gaps[0], "train_s_per_step": train_s / steps}


# Found best for the tiny demo: LoRA on lm_head only (rank 8, alpha 64), lr 5e-3. Attention/MLP-only LoRA at
# 1e-3..5e-3 moved P(correct) by only 0.02-0.05 in 60 steps, and lr 1e-2 on all-linear(+lm_head) collapsed.
DEMO = dict(lr=5e-3, lora_r=8, lora_alpha=64, target_modules=["lm_head"])


def test_grpo_learns_tiny_arithmetic(model_path, tok):
    """P(correct) 0.21 -> 0.34..0.41 in 60 steps on seeds 0-3 (~0.02 s/step train, ~0.04 s with sampling)."""
    r = learn_arithmetic(model_path, tok, seed=0, **DEMO)
    assert r["first_gap"] < 1e-4  # the trainer scores the sampled tokens exactly as generate() sampled them
    assert r["after"] > r["before"] + 0.08, r


def test_importance_sampling_cap_reweights_the_update(model_path, tok):
    """Sampler log-probs far below the trainer's: every weight is truncated at the cap, so with beta = 0 the
    gradient is exactly cap times the uncorrected one; with the option off the sampler's log-probs only feed
    logprob_gap."""
    import dataclasses

    batch = [dataclasses.replace(t, logprobs=[-30.0] * len(t.completion_ids)) for t in mixed_batch(tok)]
    plain = GRPOTrainer(model_path, cfg()).step(batch)
    capped = GRPOTrainer(model_path, cfg(importance_sampling_cap=3.0)).step(batch)
    assert "is_weight" not in plain and capped["is_weight"] == pytest.approx(3.0)
    assert capped["grad_norm"] == pytest.approx(3.0 * plain["grad_norm"], rel=1e-4)
    assert capped["logprob_gap"] == pytest.approx(plain["logprob_gap"]) and plain["logprob_gap"] > 10


# -------------------------------------------------------------------------------------------------- QLoRA


def test_qlora_step_on_cpu(model_path, tok):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    import bitsandbytes as bnb

    tr = GRPOTrainer(model_path, cfg(lr=1e-2, gradient_checkpointing=True), quantization="4bit")
    assert isinstance(tr.model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer"),
                      bnb.nn.Linear4bit)
    before = snapshot(tr)
    m = tr.step(mixed_batch(tok))
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    changed = [n for n, p in tr.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)


# ------------------------------------------------------------------------------------ batch-level options


def test_zero_variance_groups_dropped_and_counted(model_path, tok):
    import dataclasses

    batch = mixed_batch(tok)
    flat = batch + [dataclasses.replace(t, group_id="g3", rollout_id=t.rollout_id + "'") for t in batch[:2]]
    flat[-1] = dataclasses.replace(flat[-1], reward=1.0)  # group g3: outcomes 1 and 1, no signal
    kept = GRPOTrainer(model_path, cfg()).step(flat)
    dropped = GRPOTrainer(model_path, cfg(drop_zero_variance_groups=True)).step(flat)
    assert kept["zero_variance_frac"] == dropped["zero_variance_frac"] == pytest.approx(1 / 3)
    assert kept["num_transitions"] == 8 and dropped["num_transitions"] == 6 and dropped["num_skipped"] == 3
    # g3's zero advantages only dilute the rollout-normalised loss (7 rollouts -> 5): the gradient grows by 7/5
    assert dropped["grad_norm"] == pytest.approx(kept["grad_norm"] * 7 / 5, rel=1e-4)


def test_mask_truncated_leaves_length_cut_completions_out_of_the_loss(model_path, tok):
    import dataclasses

    batch = mixed_batch(tok)
    batch[2] = dataclasses.replace(batch[2], finish_reason="length")
    plain = GRPOTrainer(model_path, cfg()).step(batch)
    masked = GRPOTrainer(model_path, cfg(mask_truncated=True)).step(batch)
    assert masked["num_masked_truncated"] == 1 and masked["num_transitions"] == plain["num_transitions"] - 1
    assert masked["num_tokens"] == plain["num_tokens"] - len(batch[2].completion_ids)


def test_kl_is_reported_only_when_measured(model_path, tok):
    """With beta 0 there is no reference pass and no KL: the step reports none (not a 0.0 that was never measured),
    so no tracker or chart shows a flat KL line."""
    m = GRPOTrainer(model_path, cfg(beta=0.0)).step(mixed_batch(tok))
    assert "kl" not in m and isinstance(m["loss"], float)


def test_with_dropout_and_one_epoch_the_importance_weight_and_gap_come_from_a_dropout_free_pass(model_path, tok):
    """The sampler's log-probs are exactly the policy's (dropout-free): the importance weight is 1 and the gap 0,
    whatever dropout does to the training pass; the ratio of the one epoch stays exactly 1."""
    import time

    tr = GRPOTrainer(model_path, cfg(lora_dropout=0.5, epochs=1, importance_sampling_cap=2.0,
                                     target_modules=["all-linear", "lm_head"], micro_batch_size=64), seed=0)
    assert not tr._train_forward_is_eval
    with torch.no_grad():  # a trained adapter: LoRA's B starts at 0, where dropout on its branch changes nothing
        for name, p in tr.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    ts = mixed_batch(tok)
    plan = tr._prepare(ts, None)
    for b, clean in zip(plan.batches, tr._logprobs_frozen(plan.batches, reference=False)):
        b.sampler_logp, b.has_sampler_logp = clean.clone(), b.weights > 0
    m = tr._update(tr.adapters["default"], ts, plan, time.perf_counter())
    assert m["logprob_gap"] < 1e-5, m
    assert m["is_weight"] == pytest.approx(1.0, abs=1e-5) and m["is_capped_frac"] == 0
    assert m["ratio"] == pytest.approx(1.0, abs=1e-6) and m["clip_frac"] == 0


def test_an_update_with_nothing_to_train_logs_no_lr(model_path, tok):
    tr = GRPOTrainer(model_path, cfg(), seed=0)
    solo = [t for t in mixed_batch(tok) if t.group_id == "solo"]  # one rollout: no baseline, nothing trains
    m = tr.step(solo)
    assert "lr" not in m and m["num_transitions"] == 0
    assert "lr" in tr.step(mixed_batch(tok))


def test_the_k3_kl_pulls_back_a_token_that_drifted_far():
    """A token 3 nats less likely than under the reference: its k3 (e^3 - 4 = 16.1) counts whole and keeps its
    gradient, beta * (1 - e^3); verl's bound of 10 would zero it (docs/credit.md: measured)."""
    logp = torch.tensor([-4.0], requires_grad=True)
    ref = torch.tensor([-1.0])
    loss, st = grpo_loss(logp, logp.detach(), torch.zeros(1), torch.tensor([1.0]), clip_eps=0.2, ref_logp=ref,
                         beta=0.5)
    assert st["kl"].item() == pytest.approx(math.exp(3.0) - 4.0, rel=1e-5)
    loss.backward()
    assert logp.grad[0].item() == pytest.approx(0.5 * (1.0 - math.exp(3.0)), rel=1e-5)
    far = torch.tensor([-40.0], requires_grad=True)  # past the log-ratio clamp: finite, no gradient, no NaN
    loss, _ = grpo_loss(far, far.detach(), torch.zeros(1), torch.tensor([1.0]), clip_eps=0.2, ref_logp=ref, beta=0.5)
    loss.backward()
    assert math.isfinite(loss.item()) and far.grad[0].item() == 0.0
