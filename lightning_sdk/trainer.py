"""GRPO on LoRA / QLoRA adapters: the update phase of one training iteration.

Read top to bottom: three pure functions hold the math (advantages, per-token loss weights, the clipped loss) and
are tested on hand-computed tensors; `GRPOTrainer` only batches transitions, runs the model and steps AdamW.

One `step(transitions)` is one update phase over one collected batch:
  advantages per transition (GRPO group baseline) -> per-token weights summing to 1 over the batch
  -> (old / reference log-probs, no grad) -> for each epoch: accumulate grads over micro-batches, clip, step.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_sdk import models
from lightning_sdk.adapter import Transition
from lightning_sdk.config import TrainConfig

ADAPTER_SUBDIR = "adapter"  # where save_state puts the PEFT adapter inside a trainer checkpoint
STD_EPS = 1e-4  # added to the group std before dividing (TRL's convention)

# What step() reports when a batch leaves nothing to train on (e.g. every group has a single rollout).
_EMPTY_METRICS = {"loss": 0.0, "grad_norm": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio": 1.0, "adv_mean": 0.0,
                  "adv_std": 0.0, "num_transitions": 0.0, "num_tokens": 0.0, "logprob_gap": math.nan}


# ----------------------------------------------------------------------------------------------------- the math


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


# ------------------------------------------------------------------------------------------------------ batching


@dataclass
class _Batch:
    """One micro-batch on the device: prompts left-padded, completions right-padded, so every completion starts at
    the same column and the model only needs logits for the last C+1 positions."""

    input_ids: torch.Tensor  # [B, P+C]
    attention_mask: torch.Tensor  # [B, P+C]
    position_ids: torch.Tensor  # [B, P+C] positions count from each row's first real token, as when sampling
    targets: torch.Tensor  # [B, C] completion ids (0 on padding)
    weights: torch.Tensor  # [B, C] loss weight per token (0 on padding)
    adv: torch.Tensor  # [B, 1]
    temperature: torch.Tensor  # [B, 1, 1]
    sampler_logp: torch.Tensor  # [B, C] the sampler's log-probs (0 where absent)
    has_sampler_logp: torch.Tensor  # [B, C] bool


def _collate(ts: Sequence[Transition], adv: torch.Tensor, w: torch.Tensor, device: str) -> _Batch:
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
    # A greedy call (temperature 0) has no sampling distribution to match; score it at temperature 1.
    temps = torch.tensor([t.temperature if t.temperature > 0 else 1.0 for t in ts]).view(B, 1, 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    fields = (ids, mask, pos, ids[:, P:], weights, adv.view(B, 1), temps, slp, has)
    return _Batch(*(x.to(device) for x in fields))


def _drop_single_rollout_groups(ts: Sequence[Transition]) -> list[Transition]:
    """A group with one rollout has no baseline to compare against: it carries no GRPO signal."""
    rollouts: dict[str, set[str]] = defaultdict(set)
    for t in ts:
        rollouts[t.group_id].add(t.rollout_id)
    return [t for t in ts if len(rollouts[t.group_id]) > 1]


def lora_targets(model: torch.nn.Module, target_modules: list[str] | str) -> list[str] | str:
    """peft's target_modules. "all-linear" alone is peft's own shorthand (every linear layer but the output head);
    a list may hold "all-linear" plus extras such as "lm_head", which peft does not accept, so expand it here."""
    if isinstance(target_modules, str) or "all-linear" not in target_modules:
        return target_modules
    head = model.get_output_embeddings()
    names = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    return sorted(names | (set(target_modules) - {"all-linear"}))


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@contextmanager
def _atomic_dir(path: str | Path) -> Iterator[Path]:
    """Write into a temp dir beside `path`, then rename it into place: a kill mid-write leaves only a hidden temp."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            path.rename(old / path.name)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------- trainer


class GRPOTrainer:
    """A LoRA (or QLoRA) adapter on a frozen base model, trained with GRPO from transitions."""

    def __init__(self, model_path: str, config: TrainConfig, *, quantization: str = "none", dtype: str = "auto",
                 seed: int = 0) -> None:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        self.config = config
        self.device = resolve_device(config.device)
        self.global_step = 0
        torch.manual_seed(seed)  # the LoRA init
        random.seed(seed)
        base = models.load_causal_lm(models.resolve(model_path), dtype=dtype, quantization=quantization,
                                     device=self.device)
        ckpt = {"use_reentrant": False}  # non-reentrant: works with frozen inputs, no enable_input_require_grads
        with warnings.catch_warnings():
            # peft still calls transformers' v5-deprecated *gradient_checkpointing* names; nothing for a user to fix
            warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6", category=FutureWarning)
            if quantization == "4bit":
                # fp32 norms/head and (optionally) checkpointing: the standard QLoRA preparation
                base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=config.gradient_checkpointing,
                                                       gradient_checkpointing_kwargs=ckpt)
            elif config.gradient_checkpointing:
                if hasattr(base, "activation_checkpointing_enable"):
                    base.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt)
                else:  # transformers < 5.20 (what vllm 0.32, the [gpu] extra, allows) has only the older name
                    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
            base.config.use_cache = False
            lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                              target_modules=lora_targets(base, config.target_modules), task_type="CAUSAL_LM")
            self.model = get_peft_model(base, lora)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Without dropout a training-mode forward computes exactly the log-probs an eval-mode one does.
        self._train_forward_is_eval = not any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()
        ) and not any(getattr(base.config, k, 0) for k in ("attention_dropout", "hidden_dropout", "dropout"))
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)

    def _logprobs(self, b: _Batch) -> torch.Tensor:
        """Log-probs [B, C] of the completion tokens under the current model, from temperature-scaled logits."""
        C = b.targets.shape[1]
        out = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                         logits_to_keep=C + 1, use_cache=False)
        logits = out.logits[:, :-1].float() / b.temperature  # position j predicts token j+1
        return torch.log_softmax(logits, dim=-1).gather(-1, b.targets.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def _logprobs_frozen(self, batches: list[_Batch], *, reference: bool) -> list[torch.Tensor]:
        """Old-policy (reference=False) or base-model (reference=True: adapter off, no second weight copy) log-probs."""
        self.model.eval()
        with self.model.disable_adapter() if reference else nullcontext():
            return [self._logprobs(b) for b in batches]

    def step(self, transitions: Sequence[Transition]) -> dict[str, float]:
        """One update phase over one collected batch: `epochs` optimizer steps, metrics averaged over them.

        Groups with a single rollout are skipped (counted in num_skipped). logprob_gap compares the sampler's
        log-probs with the trainer's temperature-scaled ones before the update: the train/inference mismatch.
        """
        t0, cfg = time.perf_counter(), self.config
        if not transitions:
            raise ValueError("GRPOTrainer.step: empty batch, no transitions to train on")
        ts = _drop_single_rollout_groups(transitions)
        m = {**_EMPTY_METRICS, "reward_mean": _rollout_mean(transitions),
             "num_skipped": float(len(transitions) - len(ts))}
        if not any(t.completion_ids for t in ts):  # nothing left to learn from: no update, not an error
            return {**m, "step": float(self.global_step), "seconds": time.perf_counter() - t0}
        adv = group_advantages([t.reward for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts],
                               cfg.scale_rewards)
        w = token_weights([len(t.completion_ids) for t in ts], [t.rollout_id for t in ts], cfg.loss_norm)
        # Similar lengths share a micro-batch (less padding); empty completions have no tokens to train.
        order = sorted((i for i, t in enumerate(ts) if t.completion_ids),
                       key=lambda i: len(ts[i].prompt_ids) + len(ts[i].completion_ids))
        chunks = [order[k:k + cfg.micro_batch_size] for k in range(0, len(order), cfg.micro_batch_size)]
        batches = [_collate([ts[i] for i in c], adv[c], w[c], self.device) for c in chunks]
        # The old policy is the one before this update, i.e. the current one during epoch 0, whose ratio is
        # exp(logp - logp.detach()) = 1 with the same gradient. Epoch 0's own log-probs then serve as the old ones
        # for later epochs; only a model with dropout (train-mode log-probs differ) pays for a separate no-grad pass.
        separate = cfg.epochs > 1 and not self._train_forward_is_eval
        olds = self._logprobs_frozen(batches, reference=False) if separate else [None] * len(batches)
        refs = self._logprobs_frozen(batches, reference=True) if cfg.beta > 0 else [None] * len(batches)

        self.model.train()
        totals: Counter[str] = Counter()
        gap, gap_n = 0.0, 0
        for epoch in range(cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, (b, ref) in enumerate(zip(batches, refs)):
                logp = self._logprobs(b)
                if olds[i] is None:  # epoch 0 without a separate pass: this is the old policy
                    olds[i] = logp.detach()
                old = olds[i]
                if epoch == 0:  # no update yet: this is the policy the sampler ran, so compare with its log-probs
                    gap += ((logp.detach() - b.sampler_logp).abs() * b.has_sampler_logp).sum().item()
                    gap_n += int(b.has_sampler_logp.sum())
                is_w = (None if cfg.importance_sampling_cap is None else
                        sampler_is_weight(old, b.sampler_logp, b.has_sampler_logp, cfg.importance_sampling_cap))
                loss, st = grpo_loss(logp, old, b.adv, b.weights, clip_eps=cfg.clip_eps,
                                     clip_eps_high=cfg.clip_eps_high, ref_logp=ref, beta=cfg.beta, is_weight=is_w)
                loss.backward()  # weights sum to 1 over the whole batch: accumulated grads == full-batch grads
                totals.update({"loss": loss.item(), **{k: v.item() for k, v in st.items()}})
            totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
            self.optimizer.step()
        self.model.eval()
        self.global_step += 1
        if self.device.startswith("cuda"):
            # Hand the allocator's cached blocks back, so a sleeping inference server on this GPU can wake into them.
            torch.cuda.empty_cache()

        kept = adv[order]
        m.update({k: v / cfg.epochs for k, v in totals.items()})
        m.update(adv_mean=kept.mean().item(), adv_std=kept.std().item() if len(order) > 1 else 0.0,
                 num_transitions=float(len(order)), num_tokens=float(sum(len(ts[i].completion_ids) for i in order)),
                 logprob_gap=gap / gap_n if gap_n else math.nan, step=float(self.global_step),
                 seconds=time.perf_counter() - t0)
        return m

    # ------------------------------------------------------------------------------------------- checkpoints

    def save_adapter(self, path: str | Path) -> None:
        """A PEFT adapter dir (adapter_config.json + adapter_model.safetensors) for PeftModel.from_pretrained."""
        with _atomic_dir(path) as tmp:
            self._save_adapter_files(tmp)

    def _save_adapter_files(self, path: Path) -> None:
        # The adapter only: with lm_head targeted peft would also copy the frozen head (vocab x hidden), which
        # the base model already has.
        self.model.save_pretrained(path, save_embedding_layers=False)

    def save_state(self, path: str | Path) -> None:
        """Everything needed to resume: adapter, optimizer, step counter, RNG. Appears only once complete."""
        with _atomic_dir(path) as tmp:
            self._save_adapter_files(tmp / ADAPTER_SUBDIR)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
                   "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
            torch.save(rng, tmp / "rng.pt")
            (tmp / "trainer_state.json").write_text(json.dumps({"global_step": self.global_step}))

    def load_state(self, path: str | Path) -> None:
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "trainer_state.json").exists():
            raise FileNotFoundError(f"{path}: not a trainer checkpoint (no trainer_state.json)")
        weights = load_file(path / ADAPTER_SUBDIR / "adapter_model.safetensors", device=self.device)
        result = set_peft_model_state_dict(self.model, weights)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing:
            raise ValueError(f"{path}: adapter does not match this model (missing {missing[:3]}...)")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device))
        rng = torch.load(path / "rng.pt")
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.global_step = json.loads((path / "trainer_state.json").read_text())["global_step"]


def _rollout_mean(ts: Sequence[Transition]) -> float:
    """Mean reward with every rollout counted once (its transitions' mean), however many calls it made."""
    per: dict[str, list[float]] = defaultdict(list)
    for t in ts:
        per[t.rollout_id].append(t.reward)
    return sum(sum(v) / len(v) for v in per.values()) / len(per)
