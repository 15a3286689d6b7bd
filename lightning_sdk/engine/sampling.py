"""Choosing each row's next token, and knowing when a row is done.

What comes back is exactly what was sampled: the token ids, and the log-probability of each under the distribution
it was drawn from. RL training needs both and must never re-tokenize the text.
"""

from __future__ import annotations

import math

import torch

from lightning_sdk.engine.batch import Row
from lightning_sdk.train.grpo import top_p_keep


def sample_next(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, rows: list[Row],
            generator: torch.Generator):
    """Per-row greedy or temperature/top-k/top-p sampling.

    Log-probs are of the distribution each token was drawn from: the temperature-scaled softmax, renormalised over
    the tokens kept (what vLLM reports with processed_logprobs): the top_k most probable, then the top-p nucleus of
    those, as vLLM applies them. The trainer recomputes top_p alone with the same `top_p_keep`; a top_k call is
    served as asked and left out of training by the gateway's record ("setting:top_k"). Greedy rows report the raw
    log-softmax. Top log-probs come from the same distribution (-inf outside the tokens kept).
    """
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)
    probs = logp.exp()
    # Inverse-CDF sampling with one uniform per row, so a request with a seed draws from its own generator
    # and gets the same reply whatever else shares the batch. Each row's CDF runs over the same token order
    # whatever its neighbours ask for: vocabulary order, or (top-p rows only) descending probability.
    u = torch.rand(len(rows), generator=generator)
    seeded: dict[int, list[int]] = {}
    for b, r in enumerate(rows):
        if r.job.generator is not None:
            seeded.setdefault(id(r.job), []).append(b)
    for bs in seeded.values():
        u[bs] = torch.rand(len(bs), generator=rows[bs[0]].job.generator)
    picked = inverse_cdf(probs, u)
    top_ks = torch.tensor([r.req.top_k for r in rows])
    limited = (((top_ps < 1) | (top_ks > 0)) & ~greedy).nonzero().squeeze(1)
    if len(limited):
        # One mask for drawing and for reporting: the token drawn is always among the tokens reported.
        p, k = probs[limited], top_ks[limited].unsqueeze(1)
        order = p.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(p.shape[1]).expand_as(order))
        in_top_k = (rank < k) | (k <= 0)
        # top_p over the top-k renormalised; rows without top_k keep the exact probabilities the trainer sees
        kept = p * in_top_k
        p_for_top_p = torch.where(k > 0, kept / kept.sum(-1, keepdim=True), p)
        keep = in_top_k & top_p_keep(p_for_top_p, top_ps[limited].unsqueeze(1))
        picked[limited] = order.gather(1, inverse_cdf((p * keep).gather(1, order), u[limited]))
        logp[limited] = torch.log_softmax(logp[limited].masked_fill(~keep, -math.inf), dim=-1)
    tokens = torch.where(greedy, logits.argmax(-1), picked.squeeze(1))
    token_logp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = max(r.req.top_logprobs for r in rows)
    top = None
    if k:
        values, indices = logp.topk(k, dim=-1)
        top = [list(zip(indices[b, :r.req.top_logprobs].tolist(), values[b, :r.req.top_logprobs].tolist()))
               for b, r in enumerate(rows)]
    return tokens, token_logp, top


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, 1] index of the token each row's uniform falls on, under its (unnormalised) probabilities.

    In float64: a float32 running sum over a 150k-token vocabulary drifts far enough that the tokens drawn no
    longer follow the probabilities reported for them."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True).clamp(max=cdf.shape[1] - 1)


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends after `start` (the text before it was already checked)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
