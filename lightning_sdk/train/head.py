"""The LM head applied only where the loss reads it: the trained (completion) positions of a micro-batch.

A causal LM's forward is decoder -> hidden states -> head (hidden x vocabulary, the largest matmul of a small model
with a large vocabulary) -> logits. The update needs logits only at the tokens it trains; prompts, the observations
inside a packed row (train.packing) and padding carry no loss. So the decoder runs on every token, and the head
only on the hidden states gathered at the trained positions, through transformers' and peft's public accessors
(`get_base_model`, `get_decoder`, `get_output_embeddings`): peft's LoRA layers sit inside those modules, so an
adapter on the head or the decoder applies as in the full forward.

A family whose forward does more than `head(hidden)` must be reproduced here: Gemma 2/3's
`final_logit_softcapping` is. Any other difference is caught by a check at load (the full forward against this
path on a few tokens), and that model then takes the full head at every position, with the reason logged.

Rows that share a prompt (train.packing.share) are read through the trainer's own attention (train/attention.py),
to which the model is switched at load. A second check at load compares rows read that way, sharing a prompt, with
the same rows read apart through the model's own attention; a model that fails it, or that attends through a
sliding window, keeps its own attention and has its rows read apart, with the reason logged.
"""

from __future__ import annotations

import logging

import torch

from lightning_sdk import compat
from lightning_sdk.train import attention
from lightning_sdk.train.attention import LAYOUT, Layout

log = logging.getLogger("lightning_sdk")


class TrainedPositionHead:
    """Logits [N, V] at the N positions that predict the trained tokens (train.microbatch.Batch.src)."""

    def __init__(self, model: torch.nn.Module) -> None:
        """`model`: the peft model the trainer trains (its adapters already added)."""
        base = model.get_base_model()
        self._model = model
        self._decoder = base.get_decoder()
        self._head = base.get_output_embeddings()
        self._softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
        self.full_head_reason: str | None = None  # why every position goes through the head (None: it does not)
        if _sharded(model):
            # FSDP gathers the root group's parameters (embeddings, final norm, head) in the whole model's forward
            # only: the decoder called alone would read its shards.
            self.full_head_reason = "the model is sharded (train.shard = 'fsdp')"
        elif self._decoder is None or self._decoder is base or self._head is None:
            self.full_head_reason = f"{type(base).__name__} has no separate decoder and output embeddings"
        else:
            self.full_head_reason = self._check()
        if self.full_head_reason:
            log.warning("train: the LM head runs on every position (slower update): %s", self.full_head_reason)
        # why rows with the same prompt are read apart (None: they share it, through train/attention.py)
        self.shared_prompt_reason = _sliding(base) or self._share(base)
        if self.shared_prompt_reason:
            log.warning("train: calls with the same prompt are read apart (slower update): %s",
                        self.shared_prompt_reason)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                 rows: torch.Tensor, cols: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
        """Logits [N, V] from the hidden states at (rows[i], cols[i]); `layout`: the rows' shared prompts."""
        extra = {} if layout is None else {LAYOUT: layout}
        if self.shared_prompt_reason is None and attention_mask.dim() == 2:
            attention_mask = None  # the trainer's attention: right-padded rows need no mask
        if self.full_head_reason:
            start = int(cols.min()) if cols.numel() else input_ids.shape[1] - 1
            out = self._model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              logits_to_keep=input_ids.shape[1] - start, use_cache=False, **extra)
            return out.logits[rows, cols - start]
        hidden = self._decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, **extra).last_hidden_state
        return self._logits(hidden[rows, cols])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._head(hidden)
        if self._softcap is not None:  # Gemma 2/3: cap * tanh(logits / cap), as their forward does
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @torch.no_grad()
    def _check(self) -> str | None:
        """None when this path gives the full forward's logits on a few tokens; else why not."""
        vocab = int(self._head.weight.shape[0])
        device = self._head.weight.device
        ids = (torch.arange(1, 6, device=device) % vocab).unsqueeze(0)
        mask = torch.ones_like(ids)
        pos = torch.arange(ids.shape[1], device=device).unsqueeze(0)
        training = self._model.training
        self._model.eval()
        try:
            full = self._model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
            hidden = self._decoder(input_ids=ids, attention_mask=mask, position_ids=pos,
                                   use_cache=False).last_hidden_state
            mine = self._logits(hidden).float()
        except Exception as e:  # noqa: BLE001 - any failure of the split path means: use the full one
            return f"the decoder alone failed ({type(e).__name__}: {e})"
        finally:
            self._model.train(training)
        scale = float(full.abs().max()) or 1.0
        if mine.shape != full.shape or not torch.allclose(mine, full, rtol=1e-3, atol=1e-3 * scale):
            return (f"{type(self._model.get_base_model()).__name__}'s forward does more than head(decoder(x)) "
                    f"(max |difference| {float((mine - full).abs().max()) if mine.shape == full.shape else 'shape'})")
        return None

    @torch.no_grad()
    def _share(self, base: torch.nn.Module) -> str | None:
        """Switch `base` to the trainer's attention when rows read through it, two of them sharing a prompt (three
        branches of unequal lengths, and a row of one branch padded beside them), give the logits the model's own
        attention gives each read alone; else leave the model's attention as it is and say why not."""
        vocab = int(self._model.get_output_embeddings().weight.shape[0])
        device = next(self._model.parameters()).device
        prompt, tails, alone = [1, 2, 3], [[4, 5], [6, 7, 8], [9]], [10, 11]
        training = self._model.training
        self._model.eval()
        try:
            want = [self._logits_alone(prompt + t, vocab, device) for t in tails]
            want_alone = self._logits_alone(alone, vocab, device)
            own = compat.attn_implementation(base)
            try:
                base.set_attn_implementation(attention.register())
                shared = attention.layout([3, 2], [[(3, 5), (5, 8), (8, 9)], [(0, 2)]])
                ids = torch.tensor([prompt + sum(tails, []), alone + [0] * 7], device=device) % vocab
                pos = torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5, 3], list(range(9))], device=device)
                got = self._model(input_ids=ids, position_ids=pos, use_cache=False, **{LAYOUT: shared}).logits
            except Exception as e:  # noqa: BLE001 - any failure of the shared attention means: read the rows apart
                base.set_attn_implementation(own)
                return f"the shared-prompt attention failed ({type(e).__name__}: {e})"
        finally:
            self._model.train(training)
        want = torch.cat([want[0], want[1][3:], want[2][3:]]).float()
        diff = max(float((got[0].float() - want).abs().max()), float((got[1, :2].float() - want_alone).abs().max()))
        scale = float(want.abs().max()) or 1.0
        if diff > 1e-3 * scale:
            base.set_attn_implementation(own)
            return (f"{type(base).__name__} does not read a shared prompt through the trainer's attention as its own "
                    f"attention reads the rows (max |difference| {diff})")
        return None

    def _logits_alone(self, tokens: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        row = torch.tensor([tokens], device=device) % vocab
        return self._model(input_ids=row, attention_mask=torch.ones_like(row), use_cache=False,
                           position_ids=torch.arange(row.shape[1], device=device).unsqueeze(0)).logits[0].float()


def _sliding(base: torch.nn.Module) -> str | None:
    """Why the shared-prompt attention would change what `base` attends to: a sliding window (None: it has none)."""
    c = base.config.get_text_config()
    layers = getattr(c, "layer_types", None) or []
    if any(t != "full_attention" for t in layers) or (getattr(c, "sliding_window", None)
                                                      and getattr(c, "use_sliding_window", True)):
        return (f"{type(base).__name__} attends through a sliding window, which the shared-prompt attention does not "
                f"apply")
    return None


def _sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
