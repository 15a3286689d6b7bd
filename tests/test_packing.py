"""Calls that extend one another, packed into one row (train.packing), and rows with the same prompt read as
branches of one sequence, train exactly as separate rows: the rag cookbook agent's real records (tests/rag_transitions.json: one iteration of `lightning run` on cookbook/rag, 32
rollouts of 1-3 calls), every loss normaliser, GSPO, the KL term, grammar-masked calls, truncated calls, and rows
spread over micro-batches. The update's loss, statistics and gradients are compared with the packing off."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from unittest import mock

import pytest
import torch

from lightning_sdk import models
from lightning_sdk.config import TrainConfig
from lightning_sdk.constraint import Constraint
from lightning_sdk.train import microbatch
from lightning_sdk.train.head import TrainedPositionHead
from lightning_sdk.train.microbatch import split
from lightning_sdk.train.packing import pack, share
from lightning_sdk.train.trainer import GRPOTrainer
from lightning_sdk.transitions import Transition

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rag_path() -> str:
    return models.resolve(f"tiny:{ROOT / 'cookbook' / 'rag' / 'teacher.py'}")


@pytest.fixture(scope="module")
def records() -> list[Transition]:
    rows = json.loads((Path(__file__).parent / "rag_transitions.json").read_text())
    ts = [Transition(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()}) for r in rows]
    groups = sorted({t.group_id for t in ts})[:3]  # 3 groups of 4 rollouts: enough chains, cheap on 2 cores
    return [t for t in ts if t.group_id in groups]


def test_the_rag_agent_s_calls_extend_one_another(records):
    rows = pack(records, [True] * len(records))
    assert len(rows) < len(records) and max(len(r.segments) for r in rows) == 3, [len(r.segments) for r in rows]
    # every call is in exactly one row, its completion at its place in the row
    seen = sorted(s.index for r in rows for s in r.segments)
    assert seen == list(range(len(records)))
    for r in rows:
        for s in r.segments:
            t = records[s.index]
            assert (r.prompt_ids + r.tail)[:len(r.prompt_ids) + s.start + s.length] == t.prompt_ids + t.completion_ids
    assert sum(r.length for r in rows) < 0.7 * sum(len(t.prompt_ids) + len(t.completion_ids) for t in records)
    # a group's rollouts start from the same task: their rows share it, each a branch that sees it and itself
    shared = share(rows, records, 4)
    assert max(len(r.branches) for r in share(rows, records, 2)) == 2
    assert max(len(r.branches) for r in shared) == 4 and sum(r.length for r in shared) < sum(r.length for r in rows)
    assert sorted(s.index for r in shared for s in r.segments) == list(range(len(records)))
    for r in shared:
        for s in r.segments:
            b = max(b for b in r.branches if b <= s.start)
            t = records[s.index]
            assert (r.prompt_ids + r.tail[b:])[:len(r.prompt_ids) + s.start - b + s.length] == (t.prompt_ids
                                                                                               + t.completion_ids)
    # micro-batches: every row once, in order, at most max_rows each; rows of very different lengths apart
    by_length = sorted(shared, key=lambda r: r.length)
    cut = split(by_length, 5, 10**9)
    assert [r for c in cut for r in c] == by_length and max(map(len, cut)) <= 5
    assert len(cut) > -(-len(shared) // 5)
    budget = 2 * by_length[-1].length  # at most two of the longest rows' tokens a pass, padding included
    assert all(len(c) * c[-1].length <= budget for c in split(by_length, 5, budget))


def update(path: str, ts: list[Transition], packed: bool, full_head: bool = False,
           targets: list[str] | str = ("all-linear", "lm_head"), dense_up_to: int = 0,
           **kw) -> tuple[dict, dict[str, torch.Tensor]]:
    """One update with plain SGD (lr 1, no clipping): the parameters move by exactly minus the gradient.
    `full_head`: the LM head on every position, as a model the head check rejects takes it (train/head.py).
    `dense_up_to`: train.microbatch.DENSE_UP_TO (0: every shared prompt through train/attention.py's own calls)."""
    with mock.patch.object(microbatch, "DENSE_UP_TO", dense_up_to):
        return _update(path, ts, packed, full_head, targets, **kw)


def _update(path, ts, packed, full_head, targets, **kw):
    cfg = TrainConfig(lr=1.0, lora_r=8, lora_alpha=16, target_modules=targets if isinstance(targets, str)
                      else list(targets), micro_batch_size=5, max_grad_norm=1e9, importance_sampling_cap=2.0,
                      pack_calls=packed, **kw)
    tr = GRPOTrainer(path, cfg, seed=0, dtype="float32")
    # the tiny model passes both checks: the head on trained tokens only, rows with one prompt share it
    assert tr.head.full_head_reason is None and tr.head.shared_prompt_reason is None
    if full_head:
        tr.head.full_head_reason = "compared with the full head"
    with torch.no_grad():  # a trained adapter: LoRA's B starts at 0, where A's gradient is 0
        g = torch.Generator().manual_seed(1)
        for name, p in tr.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.optimizer = torch.optim.SGD(tr.params, lr=1.0)
    m = tr.step(ts)
    grads = {n: before[n] - p.detach() for n, p in tr.model.named_parameters() if p.requires_grad}
    return m, grads


# Each loss normaliser once; the KL term, truncated calls, grammar masks and GSPO ride along with one of them.
VARIANTS = {
    "rollout+kl": {"beta": 0.04}, "token+constrained": {"loss_norm": "token"}, "sequence": {"loss_norm": "sequence"},
    "constant+truncated": {"loss_norm": "constant", "max_completion_length": 64, "mask_truncated": True},
    "bnpo": {"loss_norm": "bnpo"},
    "gspo": {"importance_sampling_level": "sequence", "epochs": 2, "clip_eps": 3e-4, "clip_eps_high": 4e-4},
}


@pytest.mark.parametrize("variant", list(VARIANTS) + ["dense mask"])
def test_packed_rows_train_exactly_as_separate_rows(rag_path, records, variant):
    """Every variant through the trainer's shared-prompt attention; "dense mask": short rows as the trainer reads
    them by default, through one [B, 1, L, L] mask (train.microbatch.DENSE_UP_TO)."""
    ts = list(records)
    if "truncated" in variant:  # the middle call of every 3-call chain cut by max_tokens: context, not trained
        rows = pack(ts, [True] * len(ts))
        for r in rows:
            if len(r.segments) == 3:
                i = r.segments[1].index
                ts[i] = dataclasses.replace(ts[i], finish_reason="length")
    if "constrained" in variant:  # every call sampled under a grammar that allows any text: masks are replayed
        free = Constraint("regex", r"[\s\S]*").to_json()
        ts = [dataclasses.replace(t, constraint=free) for t in ts]
    kw = VARIANTS.get(variant, {"dense_up_to": 1 << 30})
    today, g0 = update(rag_path, ts, packed=False, **kw)
    packed, g1 = update(rag_path, ts, packed=True, **kw)
    assert packed["num_input_tokens"] < today["num_input_tokens"]
    for k in ("num_transitions", "num_tokens", "num_masked_truncated", "num_constrained", "constraint_mismatch"):
        assert packed[k] == today[k], k
    if "truncated" in variant:
        assert today["num_masked_truncated"] > 0
    if "constrained" in variant:
        assert today["num_constrained"] == len(ts) and today["constraint_mismatch"] == 0
    for k in ("loss", "clip_frac", "ratio", "kl", "is_weight", "is_capped_frac", "entropy", "logprob_gap",
              "adv_mean", "adv_std", "grad_norm"):
        if k in today:
            assert packed[k] == pytest.approx(today[k], abs=1e-6), (k, packed[k], today[k])
    assert max((g1[n] - g0[n]).abs().max().item() for n in g0) <= 1e-6
    assert max(g.abs().max().item() for g in g0.values()) > 1e-3  # the gradients compared are not all zero


def test_a_real_shape_trains_shared_prompts_exactly_as_separate_rows(records):
    """Qwen2.5-0.5B's shape (one of its layers, random weights: 14 query heads over 2 key-value heads, sdpa as
    loaded): shared prompts through the trainer's attention give the loss, statistics and gradients of rows read
    apart through the model's own."""
    path = models.resolve("shape:qwen2.5-0.5b@1")
    ts = [t for t in records if t.group_id in sorted({t.group_id for t in records})[:2]]
    today, g0 = update(path, ts, packed=False, targets="all-linear", beta=0.04)
    packed, g1 = update(path, ts, packed=True, targets="all-linear", beta=0.04)
    assert packed["num_input_tokens"] < 0.5 * today["num_input_tokens"]
    for k in ("loss", "clip_frac", "ratio", "kl", "is_weight", "entropy", "logprob_gap", "grad_norm"):
        assert packed[k] == pytest.approx(today[k], abs=1e-6), (k, packed[k], today[k])
    assert max((g1[n] - g0[n]).abs().max().item() for n in g0) <= 1e-6
    assert max(g.abs().max().item() for g in g0.values()) > 1e-3


@pytest.mark.parametrize("packed", [False, True])
def test_the_head_on_trained_tokens_only_trains_as_the_full_head(rag_path, records, packed):
    """The head applied to the hidden states of the trained tokens only (train/head.py) against the full head over
    every position: same loss, statistics and gradients, with the KL term, top-p, grammar masks and truncated calls
    (context only) in the batch, the LoRA on the head too."""
    free = Constraint("regex", r"[\s\S]*").to_json()
    ts = [dataclasses.replace(t, constraint=free if i % 2 else None, top_p=0.9 if i % 3 else 1.0,
                              finish_reason="length" if i % 5 == 1 else t.finish_reason)
          for i, t in enumerate(records)]
    kw = {"beta": 0.04, "mask_truncated": True}
    full, g0 = update(rag_path, ts, packed, full_head=True, **kw)
    mine, g1 = update(rag_path, ts, packed, **kw)
    assert full["num_masked_truncated"] > 0 and full["num_constrained"] > 0 and full["constraint_mismatch"] == 0
    for k in ("loss", "clip_frac", "ratio", "kl", "is_weight", "is_capped_frac", "entropy", "logprob_gap",
              "grad_norm"):
        assert mine[k] == pytest.approx(full[k], abs=1e-6), (k, mine[k], full[k])
    assert max((g1[n] - g0[n]).abs().max().item() for n in g0) <= 1e-6
    assert max(g.abs().max().item() for g in g0.values()) > 1e-3


def test_a_model_that_would_not_read_a_shared_prompt_as_its_rows_reads_them_apart(rag_path):
    """The load-time check of the shared-prompt attention (train/head.py): a model loaded with eager attention reads
    shared prompts through it too; a sliding window is caught, with the reason, and the model keeps its own
    attention."""
    from peft import LoraConfig, get_peft_model

    def head(change) -> TrainedPositionHead:
        base = models.load_causal_lm(rag_path, dtype="float32", device="cpu")
        change(base)
        return TrainedPositionHead(get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")))

    assert head(lambda m: None).shared_prompt_reason is None
    assert head(lambda m: m.set_attn_implementation("eager")).shared_prompt_reason is None
    assert "sliding window" in head(lambda m: setattr(m.config, "sliding_window", 64)).shared_prompt_reason


def test_an_attention_that_would_read_shared_prompts_wrong_is_refused_and_the_model_keeps_its_own(rag_path,
                                                                                                  monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import AttentionInterface

    from lightning_sdk import compat
    from lightning_sdk.train import attention

    def blind(module, query, key, value, attention_mask, **kwargs):  # ignores the layout: branches see each other
        kwargs.pop(attention.LAYOUT, None)
        return attention.attend(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("lightning_test_blind", blind)
    monkeypatch.setattr(attention, "register", lambda: "lightning_test_blind")
    base = models.load_causal_lm(rag_path, dtype="float32", device="cpu")
    head = TrainedPositionHead(get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")))
    assert "does not read a shared prompt through the trainer's attention" in head.shared_prompt_reason
    assert compat.attn_implementation(base) == "sdpa"
