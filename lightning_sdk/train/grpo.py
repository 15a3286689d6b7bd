"""The GRPO math, pure and tested on hand-computed tensors: advantages, per-token loss weights, the clipped loss,
the top-p nucleus (shared with the CPU server's sampler) and entropy.

Nothing here touches a model: `train.trainer` feeds these functions tensors it computed. docs/credit.md states the
credit rule and names each option's TRL / verl equivalent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from lightning_sdk import advantage
# STD_EPS and GroupOutcomes stay importable from here: the trainer and the tests name them with the GRPO math
from lightning_sdk.advantage import (STD_EPS, GroupOutcomes, group_outcomes, single_rollout_groups,  # noqa: F401
                                     zero_variance_groups)

# The k3 term's log-ratio is clamped (verl's low_var_kl bound) so it stays finite; its value is not bounded (TRL):
# a bound releases the KL gradient of exactly the tokens that drifted furthest (docs/credit.md, measured).
KL_LOG_RATIO_CLAMP = 20.0


def _floats(v: Sequence[float] | torch.Tensor) -> list[float]:
    return v.tolist() if isinstance(v, torch.Tensor) else [float(x) for x in v]


def group_advantages(
    outcomes: Sequence[float] | torch.Tensor,
    group_ids: Sequence[str],
    rollout_ids: Sequence[str],
    scale: str = "group",
    *,
    credit: Sequence[float] | torch.Tensor | None = None,
    shaping: Sequence[float] | torch.Tensor | None = None,
    scored: GroupOutcomes | None = None,
) -> torch.Tensor:
    """One advantage per transition (LLM call) as a float32 tensor: lightning_sdk.advantage computes it (and
    explains it to the dashboard); its docstring states the rule."""
    values = advantage.group_advantages(_floats(outcomes), group_ids, rollout_ids, scale,
                                        credit=None if credit is None else _floats(credit),
                                        shaping=None if shaping is None else _floats(shaping), scored=scored)
    return torch.tensor(values, dtype=torch.float64).float()


def token_weights(num_tokens: Sequence[int], rollout_ids: Sequence[str], loss_norm: str = "rollout", *,
                  max_completion_length: int | None = None, group_ids: Sequence[str] | None = None) -> torch.Tensor:
    """The loss weight of each completion token of each transition (all tokens of one transition weigh the same).

    Weights are fixed over the whole batch before it is split, so summing the loss over micro-batches gives
    exactly the full-batch loss and gradient; all but "constant" sum to 1 (sum_i w[i] * num_tokens[i] == 1).
      "rollout":  every rollout weighs 1/R, spread evenly over all completion tokens of all its calls
      "token":    every token weighs the same, 1/total tokens (DAPO; TRL loss_type="dapo", verl "token-mean")
      "sequence": every transition weighs 1/N, spread over its own tokens (original GRPO; TRL "grpo", verl
                  "seq-mean-token-mean")
      "constant": every token weighs 1/(N * max_completion_length), N every transition of the batch, those with
                  no tokens to train (masked as truncated, empty) included (Dr.GRPO; TRL "dr_grpo", whose
                  per_token_loss.size(0) counts them too; verl "seq-mean-token-sum-norm"): no length bias, and the
                  normaliser does not depend on which transitions have tokens
      "bnpo":     every token weighs 1/(G * tokens of its group), G groups: the token mean of each group, averaged
                  over groups (TRL "bnpo", the token mean of each local batch, with one group as the local batch);
                  needs group_ids. Never the physical micro-batches: those are cut by length, and a mean per
                  micro-batch would favour the short completions sorted together
    Transitions without completion tokens get 0 and, but for "constant", do not count.
    """
    n = torch.as_tensor(num_tokens, dtype=torch.float64)
    live = n > 0
    if not bool(live.any()):
        raise ValueError("token_weights: the batch has no completion tokens")
    if loss_norm == "token":
        w = 1.0 / n.sum().expand_as(n)
    elif loss_norm == "sequence":
        w = 1.0 / (n.clamp(min=1) * live.sum())
    elif loss_norm == "constant":
        if not max_completion_length:
            raise ValueError("loss_norm 'constant' needs max_completion_length (train.max_completion_length)")
        w = torch.full_like(n, 1.0 / (len(n) * max_completion_length))
    elif loss_norm == "bnpo":
        if group_ids is None:
            raise ValueError("loss_norm 'bnpo' needs each transition's group")
        per_group: Counter[str] = Counter()
        for g, k in zip(group_ids, num_tokens):
            per_group[g] += k
        m = sum(1 for k in per_group.values() if k > 0)
        w = torch.tensor([1.0 / (m * max(per_group[g], 1)) for g in group_ids], dtype=torch.float64)
    elif loss_norm == "rollout":
        per_rollout: Counter[str] = Counter()
        for rid, k in zip(rollout_ids, num_tokens):
            per_rollout[rid] += k
        n_rollouts = sum(1 for k in per_rollout.values() if k > 0)
        w = torch.tensor([1.0 / (n_rollouts * max(per_rollout[rid], 1)) for rid in rollout_ids], dtype=torch.float64)
    else:
        raise ValueError(f"loss_norm {loss_norm!r}: expected 'rollout', 'token', 'sequence', 'constant' or 'bnpo'")
    return torch.where(live, w, 0.0).float()


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    is_weight: torch.Tensor | None = None,
    log_ratio_clamp: float | None = 20.0,
    dual_clip: float | None = None,
    kl_bound: float | None = None,
    level: str = "token",
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped GRPO objective, weighted: sum(weights * (-is_w * min(r*A, clip(r)*A) + beta*KL)).

    All tensors broadcast to one shape (e.g. [batch, tokens], adv [batch, 1]); padding has weight 0. KL is the k3
    estimator exp(ref-logp) - (ref-logp) - 1 (>= 0, unbiased, low variance). is_weight (no gradient; see
    sampler_is_weight) scales the policy term only, not the KL, as in TRL. The log-ratio is clamped to
    +-log_ratio_clamp before exp (verl clamps at 20), so a far-off token gives a finite loss and no gradient, not
    NaN. dual_clip = c > 1 caps a negative-advantage token's loss at c*|A| (verl's clip_ratio_c, dual-clip PPO).
    Stats are weighted sums like the loss (means when weights sum to 1; they add up over micro-batches): clip_frac
    is the share of tokens whose gradient the clip removed, ratio the mean ratio, kl the mean KL (only when ref_logp
    is given), is_weight the mean importance weight (only when given), dual_clip_frac (only with dual_clip).
    level "sequence" (GSPO) gives every token of a row its sequence's ratio, exp(mean log-ratio over the row's
    tokens, those of weight > 0), with the gradient of that mean (TRL's importance_sampling_level="sequence").
    `segments` (same shape as logp, long) numbers the calls of a packed row (train.packing): the sequence ratio is
    then each call's own, never one across the calls of a row.
    The k3 term's log-ratio is clamped to +-KL_LOG_RATIO_CLAMP (finite, no NaN); its value is not bounded (TRL)
    unless `kl_bound` is given (verl's low_var_kl: +-10, which stops the KL gradient of the tokens furthest from the
    reference; the trainer leaves it unbounded).
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logp - old_logp
    if level == "sequence":
        real = (weights > 0).to(log_ratio.dtype).expand_as(log_ratio)
        if segments is None:
            seq = (log_ratio * real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp(min=1.0)
            log_ratio = seq.expand_as(log_ratio)
        else:
            n = int(segments.max()) + 1
            sums = log_ratio.new_zeros(*segments.shape[:-1], n).scatter_add(-1, segments, log_ratio * real)
            counts = real.new_zeros(*segments.shape[:-1], n).scatter_add(-1, segments, real).clamp(min=1.0)
            log_ratio = (sums / counts).gather(-1, segments)
    elif level != "token":
        raise ValueError(f"level {level!r}: expected 'token' or 'sequence'")
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    # The min picks the clipped (constant) branch exactly when the ratio left the trust region in the direction
    # the advantage pushes it: those tokens get no gradient.
    was_clipped = ((ratio > 1.0 + high) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
    stats = {
        "clip_frac": (weights * was_clipped).sum().detach(),
        "ratio": (weights * ratio).sum().detach(),
    }
    if dual_clip is not None:
        cap = -adv * dual_clip  # > 0 where A < 0
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual, cap.expand_as(per_token), per_token)
        stats["dual_clip_frac"] = (weights * dual).sum().detach()
    if is_weight is not None:
        per_token = per_token * is_weight
        stats["is_weight"] = (weights * is_weight).sum().detach()
    if ref_logp is not None:
        d = (ref_logp - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        kl = torch.exp(d) - d - 1.0
        if kl_bound is not None:  # verl's bound of the value (benchmarks/kl_clamp.py --bound on compares it)
            kl = kl.clamp(-kl_bound, kl_bound)
        per_token = per_token + beta * kl
        stats["kl"] = (weights * kl).sum().detach()
    return (weights * per_token).sum(), stats


def top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool mask (vocabulary order, last dim) of each row's top-p nucleus: the most probable tokens until the mass
    before a token reaches top_p (the first token always stays). Rows with top_p >= 1 keep every token.

    The CPU server samples from this nucleus and reports log-probs renormalised over it; the trainer applies the
    same mask to its own logits, so both score a token under the one distribution it was drawn from.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = (mass_before < top_p) | (top_p >= 1)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) over the last dim; -inf logits (outside a nucleus) count as 0 mass."""
    return torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1)


def sampler_is_weight(old_logp: torch.Tensor, sampler_logp: torch.Tensor, has_sampler_logp: torch.Tensor,
                      cap: float) -> torch.Tensor:
    """Truncated importance weights min(exp(old_logp - sampler_logp), cap) per token, 1 where the sampler gave none.

    The tokens were drawn from the sampler's distribution (vLLM: other kernels, maybe another precision than the
    trainer's nf4 base), while the GRPO ratio starts from the trainer's old log-probs; this reweights each token
    towards the trainer's policy, truncated at `cap` to bound the variance (TRL's vLLM importance-sampling
    correction, truncated mode).
    """
    w = torch.exp(old_logp.detach() - sampler_logp).clamp(max=cap)
    return torch.where(has_sampler_logp, w, torch.ones_like(w))
