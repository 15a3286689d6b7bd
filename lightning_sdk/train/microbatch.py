"""Transitions -> padded micro-batches on the device, laid out so the model needs logits only for completions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_sdk.transitions import Transition


@dataclass
class Batch:
    """One micro-batch on the device: prompts left-padded, completions right-padded, so every completion starts at
    the same column and the model only needs logits for the last C+1 positions."""

    input_ids: torch.Tensor  # [B, P+C]
    attention_mask: torch.Tensor  # [B, P+C]
    position_ids: torch.Tensor  # [B, P+C] positions count from each row's first real token, as when sampling
    targets: torch.Tensor  # [B, C] completion ids (0 on padding)
    weights: torch.Tensor  # [B, C] loss weight per token (0 on padding)
    adv: torch.Tensor  # [B, 1]
    temperature: torch.Tensor  # [B, 1, 1]
    top_p: torch.Tensor  # [B, 1, 1] the nucleus each row was sampled from (1: the whole vocabulary)
    sampler_logp: torch.Tensor  # [B, C] the sampler's log-probs (0 where absent)
    has_sampler_logp: torch.Tensor  # [B, C] bool
    bitmask: torch.Tensor | None = None  # [B, C, words] int32: each position's grammar mask (-1: every token)


def collate(ts: Sequence[Transition], adv: torch.Tensor, w: torch.Tensor, device: str,
            masks: Mapping[str, torch.Tensor] | None = None) -> Batch:
    """`masks`: span id -> [C, words] grammar bitmask of a constrained call (grammar.Grammars.replay)."""
    P = max(len(t.prompt_ids) for t in ts)
    C = max(len(t.completion_ids) for t in ts)
    B = len(ts)
    ids = torch.zeros(B, P + C, dtype=torch.long)
    mask = torch.zeros(B, P + C, dtype=torch.long)
    slp = torch.zeros(B, C)
    has = torch.zeros(B, C, dtype=torch.bool)
    weights = torch.zeros(B, C)
    for i, t in enumerate(ts):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        if p == 0:
            raise ValueError(f"transition {t.span_id}: empty prompt_ids (the first completion token needs a context)")
        ids[i, P - p:P + c] = torch.tensor(t.prompt_ids + t.completion_ids)
        mask[i, P - p:P + c] = 1
        weights[i, :c] = w[i]
        if t.logprobs is not None:
            if len(t.logprobs) != c:
                raise ValueError(f"transition {t.span_id}: {len(t.logprobs)} logprobs for {c} completion tokens")
            slp[i, :c] = torch.tensor(t.logprobs)
            has[i, :c] = True
    bad = [t for t in ts if not t.temperature > 0 or not 0 < t.top_p <= 1]
    if bad:
        raise ValueError(f"transition {bad[0].span_id}: temperature {bad[0].temperature}, top_p {bad[0].top_p}: "
                         f"expected temperature > 0 (greedy calls are not samples) and 0 < top_p <= 1")
    temps = torch.tensor([t.temperature for t in ts]).view(B, 1, 1)
    top_p = torch.tensor([t.top_p for t in ts]).view(B, 1, 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    fields = (ids, mask, pos, ids[:, P:], weights, adv.view(B, 1), temps, top_p, slp, has)
    bitmask = None
    mine = [(i, masks[t.span_id]) for i, t in enumerate(ts) if masks and t.span_id in masks]
    if mine:
        bitmask = torch.full((B, C, mine[0][1].shape[-1]), -1, dtype=torch.int32)
        for i, m in mine:
            bitmask[i, :len(m)] = m
        bitmask = bitmask.to(device)
    return Batch(*(x.to(device) for x in fields), bitmask=bitmask)
