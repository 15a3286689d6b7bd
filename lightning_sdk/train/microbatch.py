"""Rows (train.packing) -> padded micro-batches on the device, with where each trained token's predictor sits, so
the model's head runs at those positions only (train.head)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_sdk.train.attention import Layout, layout
from lightning_sdk.train.packing import Row
from lightning_sdk.transitions import Transition


# Rows that share prompts are read through one dense [B, 1, L, L] mask when it has at most this many entries, and
# through train/attention.py's per-row calls above it: for short rows the one masked call costs less than a few
# small calls per row and layer (benchmarks/README.md, "The trainer at a user's scale"), and the mask's memory stays
# bounded (16 MB a layer as the fp32 bias sdpa makes of it).
DENSE_UP_TO = 1 << 22


@dataclass
class Batch:
    """One micro-batch on the device: each row's prompt then its tail (completions, and in a packed row the
    observations between them), right-padded to the longest row, so padding costs what the longest row is longer.
    Per-call values are per tail token [B, C]: a packed row holds several calls."""

    input_ids: torch.Tensor  # [B, L]
    # [B, L] (1: a real token), or [B, 1, L, L] bool (query, key) where short rows share prompts (DENSE_UP_TO)
    attention_mask: torch.Tensor
    position_ids: torch.Tensor  # [B, L] from each row's first token, as when sampling (restarting after the prompt
    # in each branch)
    src: torch.Tensor  # [B, C] long: the column of the hidden state that predicts each tail token
    targets: torch.Tensor  # [B, C] tail ids (0 on padding)
    weights: torch.Tensor  # [B, C] loss weight per token (0 on padding and observations)
    adv: torch.Tensor  # [B, C] the advantage of the call each token belongs to
    temperature: torch.Tensor  # [B, C, 1] each token's call's sampling temperature (1 where nothing is trained)
    top_p: torch.Tensor  # [B, C, 1] the nucleus each token's call was sampled from (1: the whole vocabulary)
    sampler_logp: torch.Tensor  # [B, C] the sampler's log-probs (0 where absent)
    has_sampler_logp: torch.Tensor  # [B, C] bool
    bitmask: torch.Tensor | None = None  # [B, C, words] int32: each position's grammar mask (-1: every token)
    segments: torch.Tensor | None = None  # [B, C] long: which call of its row a token is (None: one call a row)
    layout: Layout | None = None  # where a row has branches sharing its prompt: each row's prompt and branches


def collate(rows: Sequence[Row], ts: Sequence[Transition], adv: torch.Tensor, w: torch.Tensor, device: str,
            masks: Mapping[str, torch.Tensor] | None = None, dense_up_to: int | None = None) -> Batch:
    """`rows` index `ts`, `adv` and `w` (one advantage and one token weight per transition); a transition of weight 0
    inside a row (masked as truncated) is read as context only. `masks`: span id -> [C, words] grammar bitmask of a
    constrained call (grammar.Grammars.replay). `dense_up_to`: DENSE_UP_TO unless given."""
    L = max(r.length for r in rows)
    C = max(len(r.tail) for r in rows)
    B = len(rows)
    ids = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    src = torch.zeros(B, C, dtype=torch.long)
    targets = torch.zeros(B, C, dtype=torch.long)
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
        ids[r, :p + c] = torch.tensor(row.prompt_ids + row.tail)
        targets[r, :c] = ids[r, p:p + c]
        mask[r, :p + c] = 1
        pos[r, :p] = torch.arange(p)
        src[r, :c] = torch.arange(p - 1, p + c - 1)
        for b0, b1 in zip(row.branches, row.branches[1:] + (c,)):
            pos[r, p + b0:p + b1] = torch.arange(p, p + b1 - b0)
            src[r, b0] = p - 1  # a branch's first token is predicted from the prompt's last, as in its own row
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
    shared = None
    if any(len(row.branches) > 1 for row in rows):
        shared = layout([len(row.prompt_ids) for row in rows],
                        [[(len(row.prompt_ids) + b0, len(row.prompt_ids) + b1)
                          for b0, b1 in zip(row.branches, row.branches[1:] + (len(row.tail),))] for row in rows])
        if B * L * L <= (DENSE_UP_TO if dense_up_to is None else dense_up_to):
            mask, shared = shared.dense(L), None
    fields = (ids, mask, pos, src, targets, weights, advs, temps, top_p, slp, has)
    bitmask = None
    if mine:
        bitmask = torch.full((B, C, mine[0][2].shape[-1]), -1, dtype=torch.int32)
        for r, start, m in mine:
            bitmask[r, start:start + len(m)] = m
        bitmask = bitmask.to(device)
    packed = any(len(row.segments) > 1 for row in rows)
    return Batch(*(x.to(device) for x in fields), bitmask=bitmask, segments=seg.to(device) if packed else None,
                 layout=shared)


def split(rows: Sequence[Row], max_rows: int, max_tokens: int) -> list[list[Row]]:
    """`rows` (sorted by length) cut into micro-batches of at most `max_rows` rows and `max_tokens` tokens, padding
    included (a longer row goes alone), where the cuts fall so that the tokens read plus a toll of one mean row per
    micro-batch are fewest: a cut is made where it saves more padding than one more pass costs. Rows of very
    different lengths (packed rows, rows sharing a prompt) pad less apart; rows of similar lengths stay together."""
    n = len(rows)
    if not n:
        return []
    toll = sum(r.length for r in rows) / n
    best = [0] + [None] * n  # best[j]: the least cost of rows[:j]; cut[j]: where its last micro-batch starts
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, max(0, j - max_rows) - 1, -1):
            if i < j - 1 and (j - i) * rows[j - 1].length > max_tokens:
                break
            cost = best[i] + (j - i) * rows[j - 1].length + toll
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], n
    while j:
        out.append(list(rows[cut[j]:j]))
        j = cut[j]
    return out[::-1]
