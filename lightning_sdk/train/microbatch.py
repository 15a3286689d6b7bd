"""Rows (train.packing) -> padded micro-batches on the device, laid out so the model needs logits only for the
tokens after each row's prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_sdk.train.packing import Row
from lightning_sdk.transitions import Transition


@dataclass
class Batch:
    """One micro-batch on the device: prompts left-padded, tails (completions, and in a packed row the observations
    between them) right-padded, so every tail starts at the same column and the model only needs logits for the
    last C+1 positions. Per-call values are per token: a packed row holds several calls."""

    input_ids: torch.Tensor  # [B, P+C]
    attention_mask: torch.Tensor  # [B, P+C]
    position_ids: torch.Tensor  # [B, P+C] positions count from each row's first real token, as when sampling
    targets: torch.Tensor  # [B, C] tail ids (0 on padding)
    weights: torch.Tensor  # [B, C] loss weight per token (0 on padding and observations)
    adv: torch.Tensor  # [B, C] the advantage of the call each token belongs to
    temperature: torch.Tensor  # [B, C, 1] each token's call's sampling temperature (1 where nothing is trained)
    top_p: torch.Tensor  # [B, C, 1] the nucleus each token's call was sampled from (1: the whole vocabulary)
    sampler_logp: torch.Tensor  # [B, C] the sampler's log-probs (0 where absent)
    has_sampler_logp: torch.Tensor  # [B, C] bool
    bitmask: torch.Tensor | None = None  # [B, C, words] int32: each position's grammar mask (-1: every token)
    segments: torch.Tensor | None = None  # [B, C] long: which call of its row a token is (None: one call a row)


def collate(rows: Sequence[Row], ts: Sequence[Transition], adv: torch.Tensor, w: torch.Tensor, device: str,
            masks: Mapping[str, torch.Tensor] | None = None) -> Batch:
    """`rows` index `ts`, `adv` and `w` (one advantage and one token weight per transition); a transition of weight 0
    inside a row (masked as truncated) is read as context only. `masks`: span id -> [C, words] grammar bitmask of a
    constrained call (grammar.Grammars.replay)."""
    P = max(len(r.prompt_ids) for r in rows)
    C = max(len(r.tail) for r in rows)
    B = len(rows)
    ids = torch.zeros(B, P + C, dtype=torch.long)
    mask = torch.zeros(B, P + C, dtype=torch.long)
    slp = torch.zeros(B, C)
    has = torch.zeros(B, C, dtype=torch.bool)
    weights = torch.zeros(B, C)
    advs = torch.zeros(B, C)
    temps = torch.ones(B, C, 1)
    top_p = torch.ones(B, C, 1)
    seg = torch.zeros(B, C, dtype=torch.long)
    mine = []
    for r, row in enumerate(rows):
        p, c = len(row.prompt_ids), len(row.tail)
        if p == 0:
            raise ValueError(f"transition {ts[row.segments[0].index].span_id}: empty prompt_ids (the first "
                             f"completion token needs a context)")
        ids[r, P - p:P + c] = torch.tensor(row.prompt_ids + row.tail)
        mask[r, P - p:P + c] = 1
        for k, s in enumerate(row.segments):
            t, span = ts[s.index], slice(s.start, s.start + s.length)
            if not t.temperature > 0 or not 0 < t.top_p <= 1:
                raise ValueError(f"transition {t.span_id}: temperature {t.temperature}, top_p {t.top_p}: expected "
                                 f"temperature > 0 (greedy calls are not samples) and 0 < top_p <= 1")
            weights[r, span], advs[r, span], seg[r, span] = w[s.index], adv[s.index], k
            temps[r, span], top_p[r, span] = t.temperature, t.top_p
            if t.logprobs is not None:
                if len(t.logprobs) != s.length:
                    raise ValueError(f"transition {t.span_id}: {len(t.logprobs)} logprobs for {s.length} completion "
                                     f"tokens")
                if w[s.index] > 0:  # a context-only call is no sample the update compares with its sampler
                    slp[r, span] = torch.tensor(t.logprobs)
                    has[r, span] = True
            if masks and t.span_id in masks:
                mine.append((r, s.start, masks[t.span_id]))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    fields = (ids, mask, pos, ids[:, P:], weights, advs, temps, top_p, slp, has)
    bitmask = None
    if mine:
        bitmask = torch.full((B, C, mine[0][2].shape[-1]), -1, dtype=torch.int32)
        for r, start, m in mine:
            bitmask[r, start:start + len(m)] = m
        bitmask = bitmask.to(device)
    packed = any(len(row.segments) > 1 for row in rows)
    return Batch(*(x.to(device) for x in fields), bitmask=bitmask, segments=seg.to(device) if packed else None)
