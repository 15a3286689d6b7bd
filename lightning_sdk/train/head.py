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
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("lightning_sdk")


class TrainedPositionHead:
    """Logits [N, V] at the N positions `keep` selects among the last C+1 (the C tail tokens' predictors)."""

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

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 keep: torch.Tensor) -> torch.Tensor:
        """`keep` [B, C] bool over the tail; position j of the tail is predicted by the hidden state before it."""
        C = keep.shape[1]
        if self.full_head_reason:
            out = self._model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              logits_to_keep=C + 1, use_cache=False)
            return out.logits[:, :-1][keep]
        hidden = self._decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self._logits(hidden[:, -C - 1:-1][keep])

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


def _sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
