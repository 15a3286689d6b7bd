"""The trainer's attention: rows that share a prompt read it once, with memory that grows with the tokens.

A micro-batch row (train.packing.Row) is a prompt followed by one or more branches, right-padded. Each branch's
tokens attend to the prompt and to their own branch, causally, exactly as in a row of their own. A dense [L, L] mask
says that, but costs the square of the row (and keeps attention off its fused kernels); here no such mask exists
(train/microbatch.py keeps one only for micro-batches short enough for it to be the cheaper: DENSE_UP_TO). Per row,
one causal attention over the prompt and the first branch (which follows it in place), then the other branches
batched: each branch's queries against the prompt's keys followed by its own, causal aligned to the bottom right
(query i of a branch of T sees the prompt and its branch up to i). On a GPU that is PyTorch's `causal_lower_right`
bias, which the flash and memory-efficient kernels take without a mask; on a CPU the same pattern is a Hankel matrix
when the queries are read in reverse (query T-1-i' sees key j iff i' + j < P + T), a strided view of one vector of P
+ 2T numbers that PyTorch's CPU flash kernel reads in place. Rows of one branch (rows read apart, packed calls) need
no mask at all: causal attention over right padding leaves every real token as it is. Right padding inside a batch
of branches is harmless the same way.

The function is registered with transformers' AttentionInterface under NAME and the model switched to it
(`set_attn_implementation`), so every layer's attention goes through `attend` with the batch's `Layout` passed as a
keyword through the model's forward (transformers hands extra keywords down to the attention function; with
gradient checkpointing too). The trainer passes no 2D mask (its rows are right-padded), and for that case the mask
function registered beside it builds none (transformers would otherwise guess packed sequences from the positions,
which restart in each branch, and build an [L, L] mask). Any other call (a 2D padding mask, a KV cache: generation
with the trainer's model) is sdpa's, unchanged. train/head.py checks at load, on the model itself, that a shared
prompt reads as its rows do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "lightning_shared_prompt"
LAYOUT = "prompt_layout"  # the keyword the Layout travels under, through the model's forward to `attend`


@dataclass(frozen=True)
class RowLayout:
    """One row: its prompt's length and its branches as (start, end) token offsets in the row (the first starts
    right after the prompt). A row of one branch has no shared prompt: it is one causal sequence."""

    prompt: int
    branches: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    rows: tuple[RowLayout, ...]

    @property
    def shared(self) -> bool:
        return any(len(r.branches) > 1 for r in self.rows)

    def dense(self, length: int) -> torch.Tensor:
        """The same rows as one [B, 1, L, L] bool mask (query, key): causal, a branch seeing the prompt and itself,
        padding the prompt and padding (no query's row empty). Cheaper than `attend`'s per-row calls for short
        rows (train.microbatch.DENSE_UP_TO)."""
        branch = torch.full((len(self.rows), length), -2, dtype=torch.long)  # -1: the prompt, -2: padding
        for r, row in enumerate(self.rows):
            branch[r, :row.prompt] = -1
            for k, (s, e) in enumerate(row.branches):
                branch[r, s:e] = k
        q, k = branch.unsqueeze(2), branch.unsqueeze(1)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        return (causal & ((k == -1) | (k == q))).unsqueeze(1)


def layout(prompts: Sequence[int], branches: Sequence[Sequence[tuple[int, int]]]) -> Layout:
    return Layout(tuple(RowLayout(p, tuple(b)) for p, b in zip(prompts, branches)))


def register() -> str:
    """NAME registered with transformers (idempotent); returns NAME for `set_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attend)
    AttentionMaskInterface.register(NAME, mask)
    return NAME


def mask(batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None,
         **kwargs) -> torch.Tensor | None:
    """No mask for the trainer's right-padded rows (no 2D mask, no cache); sdpa's mask for anything else."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, attention_mask=attention_mask,
                     **kwargs)


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, Hq, L, D], key/value [B, Hkv, L, D] -> output
    [B, L, Hq, D]. With a Layout of shared prompts (keyword LAYOUT) rows are read as it says; anything else is
    transformers' sdpa attention (causal and no mask for the trainer's right-padded rows)."""
    spec: Layout | None = kwargs.pop(LAYOUT, None)
    if spec is None or not spec.shared:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        # A window or a logit cap changes what a layer attends to; train/head.py reads such models' rows apart
        # through their own attention, so this is never reached for them.
        raise ValueError("the shared-prompt attention has no sliding window or logit cap")
    gqa = query.shape[1] != key.shape[1]
    out = torch.cat([_row(query[r], key[r], value[r], row, dropout, scaling, gqa).unsqueeze(0)
                     for r, row in enumerate(spec.rows)])
    return out.transpose(1, 2).contiguous(), None


def _row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: RowLayout, p: float, scale: float | None,
         gqa: bool) -> torch.Tensor:
    """One row [H, L, D]: the prompt with its first branch causally, then the other branches (if any) batched."""
    sdpa = F.scaled_dot_product_attention
    end = row.branches[0][1]
    parts = [sdpa(q[None, :, :end], k[None, :, :end], v[None, :, :end], dropout_p=p, is_causal=True, scale=scale,
                  enable_gqa=gqa)[0]]
    rest = row.branches[1:]
    if rest:
        n, t = row.prompt, max(e - s for s, e in rest)
        # each branch padded to t: [prompt; branch; padding] keys, [branch; padding] queries
        qb = torch.stack([_padded(q[:, s:e], t) for s, e in rest])
        kb = torch.stack([torch.cat([k[:, :n], _padded(k[:, s:e], t)], dim=1) for s, e in rest])
        vb = torch.stack([torch.cat([v[:, :n], _padded(v[:, s:e], t)], dim=1) for s, e in rest])
        out = lower_right(qb, kb, vb, p, scale, gqa)
        parts += [out[i, :, :e - s] for i, (s, e) in enumerate(rest)]
    used = rest[-1][1] if rest else end
    if used < q.shape[1]:  # the row's right padding: read by nothing
        parts.append(q.new_zeros(q.shape[0], q.shape[1] - used, v.shape[-1]))
    return torch.cat(parts, dim=1)


def _padded(x: torch.Tensor, t: int) -> torch.Tensor:
    """[H, T, D] -> [H, t, D], zeros after."""
    return F.pad(x, (0, 0, 0, t - x.shape[1])) if x.shape[1] < t else x


def lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, scale: float | None, gqa: bool,
                bias: bool | None = None) -> torch.Tensor:
    """Attention of T queries over S >= T keys, query i seeing keys up to S - T + i, without a [T, S] mask: through
    PyTorch's lower-right causal bias (`bias`; the default on a GPU) or the reversed queries' strided mask."""
    t, s = q.shape[-2], k.shape[-2]
    if q.device.type == "cuda" if bias is None else bias:
        from torch.nn.attention.bias import causal_lower_right

        if gqa:  # the flash and memory-efficient kernels behind the bias take as many key heads as query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, s), dropout_p=p, scale=scale)
    # Queries reversed: row i' (query t-1-i') sees key j iff i' + j <= s - 1, a function of i' + j.
    line = torch.zeros(t + s - 1, dtype=q.dtype, device=q.device)
    line[s:] = float("-inf")
    mask = line.as_strided((t, s), (1, 1))
    return F.scaled_dot_product_attention(q.flip(-2), k, v, attn_mask=mask, dropout_p=p, scale=scale,
                                          enable_gqa=gqa).flip(-2)
