"""The rows decoding together and their KV cache: a batch that newcomers join and finished rows leave.

Rows are left-padded so that every row's next token goes in the same (last) column; joining two batches pads
both caches on the left to a common length, and dropping rows cuts the columns no remaining row uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_sdk.engine.requests import GenerationRequest, Job


@dataclass
class Row:
    job: Job
    index: int  # choice index within the job
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""  # decoded so far (kept current only where stop strings or streaming need it)
    sent: int = 0  # characters of `text` already streamed
    matcher: Any = None  # the request's grammar matcher (xgrammar.GrammarMatcher), fed every token sampled
    thinking: bool = False  # the grammar waits for the reasoning to end (grammar.ThinkTokens): no mask till then

    @property
    def req(self) -> GenerationRequest:
        return self.job.req


@dataclass
class DecodeBatch:
    """The rows decoding together and their KV cache. `mask` covers the cache's columns (1: a real token);
    rows are aligned on the right, so a row's padding is on its left and its next token is the next column."""

    rows: list[Row]
    cache: Any
    mask: torch.Tensor  # [B, cache length]
    positions: torch.Tensor  # [B, 1] (during prefill [B, prompt]) position of each row's last token
    temps: torch.Tensor  # [B]
    top_ps: torch.Tensor  # [B]
    tokens: torch.Tensor | None = None  # [B] the last sampled token of each row: the next step's input

    def select(self, keep: list[int]) -> None:
        """Keep only these rows; cache columns that are padding for every row left are cut off."""
        self.rows = [self.rows[b] for b in keep]
        if not keep:
            return
        index = torch.tensor(keep)
        here = index.to(self.mask.device)  # the cache, mask and positions live on the model's device
        self.cache.batch_select_indices(here)
        self.mask, self.positions = self.mask[here], self.positions[here]
        self.temps, self.top_ps, self.tokens = self.temps[index], self.top_ps[index], self.tokens[index]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else 0
        if start and mergeable(self.cache):
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]
            self.mask = self.mask[:, start:]

    def join(self, other: DecodeBatch) -> DecodeBatch:
        """This batch with `other`'s rows appended: both caches left-padded to a common length and stacked."""
        if not (mergeable(self.cache) and mergeable(other.cache)):
            raise RuntimeError("this model's KV cache cannot be merged across batches")
        length = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, length), _left_pad(theirs.keys, length)])
            mine.values = torch.cat([_left_pad(mine.values, length), _left_pad(theirs.values, length)])
        self.mask = torch.cat([_left_pad(self.mask, length, dim=1), _left_pad(other.mask, length, dim=1)])
        self.rows = self.rows + other.rows
        for name in ("positions", "temps", "top_ps", "tokens"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        return self


def mergeable(cache: Any) -> bool:
    """A cache whose layers are plain growing key/value tensors (transformers' DynamicLayer): rows of two such
    caches can be padded and stacked. Sliding-window, quantized or recurrent layers cannot."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def _left_pad(x: torch.Tensor, length: int, dim: int = -2) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)

