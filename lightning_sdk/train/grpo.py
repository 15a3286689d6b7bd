"""The GRPO math, pure and tested on hand-computed tensors: advantages, per-token loss weights, the clipped loss.

Nothing here touches a model: `train.trainer` feeds these functions tensors it computed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import torch

STD_EPS = 1e-4  # added to the group std before dividing (TRL's convention)


def group_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_ids: Sequence[str],
    rollout_ids: Sequence[str],
    scale: str = "group",
) -> torch.Tensor:
    """One advantage per transition: its reward minus its group's baseline (optionally / the group's std).

    A group is the transitions sharing a group_id. The baseline weighs every *rollout* equally, whatever its number
    of LLM calls (transition weight 1 / (rollouts in group * calls in its rollout)), so an agent that made 5 calls
    does not count 5x. The std is that weighted std with Bessel's correction over rollouts, which is exactly TRL's
    `std()` when every rollout has one call. Groups with one rollout, or with all rewards equal, get 0: no signal.
    """
    if scale not in ("group", "none"):
        raise ValueError(f"scale {scale!r}: expected 'group' or 'none'")
    r = torch.as_tensor(rewards, dtype=torch.float64)  # float64: equal rewards must give exactly 0 below
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = torch.zeros_like(r)
    for idx in members.values():
        calls = Counter(rollout_ids[i] for i in idx)
        n = len(calls)
        x = r[idx]
        if n < 2 or bool(x.max() == x.min()):
            continue
        w = torch.tensor([1.0 / (n * calls[rollout_ids[i]]) for i in idx], dtype=torch.float64)
        a = x - (w * x).sum()
        if scale == "group":
            std = ((w * a * a).sum() * n / (n - 1)).sqrt()
            a = a / (std + STD_EPS)
        adv[idx] = a
    return adv.float()


def token_weights(num_tokens: Sequence[int], rollout_ids: Sequence[str], loss_norm: str = "rollout") -> torch.Tensor:
    """The loss weight of each completion token of each transition (all tokens of one transition weigh the same).

    Weights sum to 1 over the whole batch (sum_i w[i] * num_tokens[i] == 1), so the loss is a plain weighted sum
    and summing it over micro-batches gives exactly the full-batch loss and gradient.
      "rollout":  every rollout weighs 1/R, spread evenly over all completion tokens of all its calls
      "token":    every token weighs the same, 1/total tokens (DAPO)
      "sequence": every transition weighs 1/N, spread over its own tokens (original GRPO)
    Transitions without completion tokens get 0 and do not count.
    """
    n = torch.as_tensor(num_tokens, dtype=torch.float64)
    live = n > 0
    if not bool(live.any()):
        raise ValueError("token_weights: the batch has no completion tokens")
    if loss_norm == "token":
        w = 1.0 / n.sum().expand_as(n)
    elif loss_norm == "sequence":
        w = 1.0 / (n.clamp(min=1) * live.sum())
    elif loss_norm == "rollout":
        per_rollout: Counter[str] = Counter()
        for rid, k in zip(rollout_ids, num_tokens):
            per_rollout[rid] += k
        n_rollouts = sum(1 for k in per_rollout.values() if k > 0)
        w = torch.tensor([1.0 / (n_rollouts * max(per_rollout[rid], 1)) for rid in rollout_ids], dtype=torch.float64)
    else:
        raise ValueError(f"loss_norm {loss_norm!r}: expected 'rollout', 'token' or 'sequence'")
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped GRPO objective, weighted: sum(weights * (-is_w * min(r*A, clip(r)*A) + beta*KL)).

    All tensors broadcast to one shape (e.g. [batch, tokens], adv [batch, 1]); padding has weight 0. KL is the k3
    estimator exp(ref-logp) - (ref-logp) - 1 (>= 0, unbiased, low variance). is_weight (no gradient; see
    sampler_is_weight) scales the policy term only, not the KL, as in TRL. Stats are weighted sums like the loss
    (means when weights sum to 1; they add up over micro-batches): clip_frac is the share of tokens whose gradient
    the clip removed, ratio the mean ratio, kl the mean KL (only when ref_logp is given), is_weight the mean
    importance weight (only when given).
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    # The min picks the clipped (constant) branch exactly when the ratio left the trust region in the direction
    # the advantage pushes it: those tokens get no gradient.
    was_clipped = ((ratio > 1.0 + high) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
    stats = {
        "clip_frac": (weights * was_clipped).sum().detach(),
        "ratio": (weights * ratio).sum().detach(),
    }
    if is_weight is not None:
        per_token = per_token * is_weight
        stats["is_weight"] = (weights * is_weight).sum().detach()
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + beta * kl
        stats["kl"] = (weights * kl).sum().detach()
    return (weights * per_token).sum(), stats


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
