"""GRPO on LoRA / QLoRA adapters: the update phase of one training iteration.

The math is in `train.grpo` (pure functions), batching in `train.batch`; `GRPOTrainer` runs the model and steps
AdamW. One `step(transitions)` is one update phase over one collected batch:
  advantages per transition (rollout outcome vs its group, credit weight, bounded shaping; docs/credit.md)
  -> per-token weights fixed over the whole batch
  -> (old / reference log-probs, no grad) -> for each epoch: accumulate grads over micro-batches, clip, step.

With several policies ([policies]) the base model carries one named peft adapter per policy, each with its own
AdamW: advantages are computed over every call of the batch (each rollout's outcome against its whole group, so
the roles share the episode's credit), then each policy takes the update above on its own calls, its adapter active.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lightning_sdk import models
from lightning_sdk.config import Policy, TrainConfig
from lightning_sdk.constraint import DEFAULT_TOOL_FORMAT, Constraint, ConstraintError, ServerGrammar
from lightning_sdk.errors import RunError
from lightning_sdk.files import atomic_dir
from lightning_sdk.grammar import Grammars, ThinkTokens, additive_mask
from lightning_sdk.models.adapter import first_nonfinite
from lightning_sdk.models import tool_parsers
from lightning_sdk.train.microbatch import Batch, collate, split
from lightning_sdk.train.packing import pack, share, single
from lightning_sdk.train.checkpoint import ADAPTER, ADAPTERS
from lightning_sdk.train.data_parallel import OneProcess, Ranks
from lightning_sdk.advantage import batch_advantages
from lightning_sdk.train.head import TrainedPositionHead
from lightning_sdk.train.grpo import GroupOutcomes, entropy, grpo_loss, sampler_is_weight, token_weights, top_p_keep
from lightning_sdk.transitions import Transition

log = logging.getLogger("lightning_sdk")

# What step() reports when a batch leaves nothing to train on (e.g. every group has a single rollout). No "kl":
# it is reported only when measured (train.beta > 0 and a batch to measure it on), never as a 0 that was not.
_EMPTY_METRICS = {"loss": 0.0, "grad_norm": 0.0, "skipped_steps": 0.0, "clip_frac": 0.0, "ratio": 1.0, "adv_mean": 0.0,
                  "adv_std": 0.0, "num_transitions": 0.0, "num_tokens": 0.0, "logprob_gap": math.nan,
                  "entropy": math.nan}


@dataclass
class _Plan:
    """One update's input, prepared: the transitions kept, their advantages, and micro-batches in length order."""

    ts: list[Transition]
    adv: torch.Tensor
    zero_variance_frac: float  # share of the groups (of 2+ rollouts) whose outcomes were all equal
    num_masked: int  # transitions cut by max_tokens that train.mask_truncated left out of the loss
    order: list[int]  # indices into ts of the transitions with completion tokens
    batches: list[Batch]  # this process's micro-batches (with train.processes > 1, its share of the rows)
    read_tokens: int = 0  # tokens the update's forward passes read (prompts + tails of its rows, every process's)


@dataclass
class _Adapter:
    """One policy's adapter on the shared model: what trains it and what it trains on."""

    name: str  # peft's adapter name: "default" for a run's single policy, else the policy's name
    config: TrainConfig  # train.* with the policy's own lr / lora_r / lora_alpha / target_modules
    components: tuple[str, ...]  # whose calls it trains; empty: every call (the single policy)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any


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



def unsaid_server(backend: str, model_path: str) -> ServerGrammar:
    """How the inference backend `backend` ('cpu' or 'vllm') applied a recorded constraint whose record does not
    say (a store written before records carried constraint.ServerGrammar). The built-in server sampled hermes calls
    from the first token whatever the model: no reasoning parser, a tool_calls spec without "choice" in the compact
    grammar grammar.py keeps for it, one with "choice" with free whitespace. vLLM applied the parsers it detected
    from the model's files, free whitespace in tool-call arguments."""
    if backend == "vllm":
        return tool_parsers.server_grammar(model_path, compact=False)
    return ServerGrammar(DEFAULT_TOOL_FORMAT, None, compact=False)


class GRPOTrainer:
    """A LoRA (or QLoRA) adapter on a frozen base model, trained with GRPO from transitions."""

    def __init__(self, model_path: str, config: TrainConfig, *, quantization: str = "none", dtype: str = "auto",
                 seed: int = 0, total_steps: int | None = None, policies: Sequence[Policy] | None = None,
                 backend: str = "cpu", ranks: Ranks | None = None) -> None:
        """`total_steps`: optimizer steps of the whole run (iterations x epochs), the horizon of a linear or cosine
        train.lr_schedule. `policies`: one named adapter each (config.policies of a run with [policies]); none =
        one adapter, peft's "default", trained on every transition. `backend`: the inference backend that samples
        ('cpu' or 'vllm'), which decides train.importance_sampling_cap = 'auto'. `ranks`: the data-parallel
        processes this one updates with (train.ranks launches them); none = this process alone."""
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        self.config = config
        self.ranks = ranks or OneProcess()
        self._model_path = model_path
        self._grammars: Grammars | None = None  # made for the first constrained call
        self._think: ThinkTokens | None = None  # a Qwen3's: its grammars start where its thinking ends
        self._backend = backend
        self._unsaid: ServerGrammar | None = None  # how this run's backend applied records that do not say
        self.importance_sampling_cap = config.sampling_cap(backend)
        self.device = resolve_device(config.device)
        self.global_step = 0
        torch.manual_seed(seed)  # the LoRA init
        base = models.load_causal_lm(model_path, dtype=dtype, quantization=quantization,
                                     device=self.ranks.load_device(self.device))
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
            specs = [("default", config, ())] if policies is None else [(p.name, p.train, p.components)
                                                                        for p in policies]
            # Named from the bare model: once the first adapter is in, its layers are peft's wrappers.
            targets = [lora_targets(base, c.target_modules) for _, c, _ in specs]
            for i, (name, c, _) in enumerate(specs):
                lora = LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=config.lora_dropout,
                                  target_modules=targets[i], task_type="CAUSAL_LM")
                if i == 0:
                    self.model = get_peft_model(base, lora, adapter_name=name)
                else:
                    self.model.add_adapter(name, lora)
        self.model = self.ranks.shard(self.model)  # before the optimizers: they step the parameters it holds
        self.head = TrainedPositionHead(self.model)  # the LM head at the trained tokens only (or why not)
        self.adapters: dict[str, _Adapter] = {}
        self._multi = policies is not None  # named adapters, metrics and checkpoint files per policy
        for name, c, components in specs:
            params = ([p for p in self.model.parameters() if p.requires_grad] if policies is None
                      else _adapter_params(self.model, name))
            optimizer = torch.optim.AdamW(params, lr=c.lr, weight_decay=config.weight_decay)
            self.adapters[name] = _Adapter(name, c, components, params, optimizer,
                                           _lr_scheduler(optimizer, config, total_steps))
        if policies is not None:
            self.model.set_adapter(specs[0][0])
        self.ranks.broadcast(self._all_params())  # every process starts from process 0's adapter
        # Without dropout a training-mode forward computes exactly the log-probs an eval-mode one does.
        self._train_forward_is_eval = not any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()
        ) and not any(getattr(base.config, k, 0) for k in ("attention_dropout", "hidden_dropout", "dropout"))
        if config.epochs > 1 and not self._train_forward_is_eval:
            # The old policy's log-probs come from a dropout-free pass, the new ones from a dropout pass: epoch 0's
            # ratio is then not 1, and the clip acts on dropout noise as well as on the policy's change.
            log.warning("train.lora_dropout = %g (or the model's own dropout) with train.epochs = %d: the GRPO ratio "
                        "compares a dropout pass with a dropout-free one, so it differs from 1 before any update; "
                        "set train.lora_dropout = 0 for an exact ratio", config.lora_dropout, config.epochs)

    # The single policy's parameters, optimizer and schedule (a run without [policies]); settable, for tools that
    # swap the optimizer.
    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self._single().params

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._single().optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        self._single().optimizer = value

    @property
    def scheduler(self) -> Any:
        return self._single().scheduler

    def held_parameters(self) -> dict[str, int]:
        """The base model's parameters this process holds ('held') of all of them ('total'): all without sharding,
        about 1/train.processes of them with train.shard = 'fsdp'."""
        adapters = {id(p) for p in self._all_params()}
        base = [p for p in self.model.parameters() if id(p) not in adapters]
        return {"held": sum(self.ranks.held(p) for p in base), "total": sum(p.numel() for p in base)}

    def _single(self) -> _Adapter:
        if self._multi:
            raise AttributeError(f"this trainer holds several policies {list(self.adapters)}: see .adapters")
        return self.adapters["default"]

    def _logits(self, b: Batch) -> torch.Tensor:
        """[N, V] logits at the batch's N trained tokens (`_trained`, in row-major order) of the distribution each
        was sampled from: temperature-scaled, -inf outside what the call's grammar allowed there (constrained calls)
        and outside the row's top-p nucleus of what is left (the CPU server's and vLLM's processed log-probs
        renormalise over the same set). The head runs at those positions only (train/head.py)."""
        keep = _trained(b)
        rows, cols = keep.nonzero(as_tuple=True)
        hidden_at = b.src[rows, cols]
        logits = (self.head(b.input_ids, b.attention_mask, b.position_ids, rows, hidden_at, b.layout).float()
                  / b.temperature[keep])
        if b.bitmask is not None:  # a constrained call: the tokens its grammar allowed at each position, as sampled
            logits = logits + additive_mask(b.bitmask[keep], logits.shape[-1])
        top_p = b.top_p[keep]
        if bool((top_p < 1).any()):
            with torch.no_grad():
                # The sampled token was inside the sampler's nucleus by construction; keeping it when a float
                # tie puts it just outside ours keeps every log-prob finite.
                keep_p = top_p_keep(torch.softmax(logits, dim=-1), top_p).scatter(-1, b.targets[keep].unsqueeze(-1),
                                                                                  True)
            logits = logits.masked_fill(~keep_p, -math.inf)
        return logits

    def _logprobs(self, b: Batch) -> torch.Tensor:
        """Log-probs [B, C] of the completion tokens under the current model (see _logits); 0 where not trained."""
        return _gather(self._logits(b), b)

    @torch.no_grad()
    def _logprobs_frozen(self, batches: list[Batch], *, reference: bool) -> list[torch.Tensor]:
        """Old-policy (reference=False) or base-model (reference=True: adapter off, no second weight copy) log-probs."""
        self.model.eval()
        with self.model.disable_adapter() if reference else nullcontext():
            return [self._logprobs(b) for b in batches]

    def step(self, transitions: Sequence[Transition], scored: GroupOutcomes | None = None, *,
             advantages: Sequence[float] | None = None) -> dict[str, float]:
        """One update phase over one collected batch: `epochs` optimizer steps, metrics averaged over them. With
        several policies each takes its own (its adapter, its calls) and its metrics are named `<policy>.<key>`.

        `scored`: group id -> {rollout id: outcome} of every scored rollout of each group, those that left no
        transition included; the group baselines come from it (without it, from the transitions' rollouts).
        `advantages`: one per transition, made elsewhere (production traffic has no re-run groups: its estimator is
        production.traffic_advantage); they replace the group advantages. One policy only."""
        if advantages is not None and (self._multi or len(advantages) != len(transitions)):
            raise ValueError(f"GRPOTrainer.step: {len(advantages)} advantages for {len(transitions)} transitions "
                             f"(expected one each, and one policy)")
        if advantages is not None and not all(math.isfinite(float(v)) for v in advantages):
            raise ValueError("GRPOTrainer.step: an advantage is not a finite number; nothing non-finite is trained on")
        t0 = time.perf_counter()
        # keyed by (rollout, call): one call may be in two samples of a batch, each with its own advantage
        given = None if advantages is None else dict(zip(((t.rollout_id, t.span_id) for t in transitions),
                                                         map(float, advantages)))
        transitions, masks, mismatched = self._replay(transitions)
        if not transitions and mismatched:  # every call of the batch left out: no update, not an error
            self._advance_schedule(self.config.epochs)
            return {**_EMPTY_METRICS, "num_constrained": 0.0, "constraint_mismatch": float(mismatched),
                    "step": float(self.global_step), "seconds": time.perf_counter() - t0}
        if not self._multi:
            a = self.adapters["default"]
            plan = self._prepare(transitions, scored, masks=masks, given=given)
            m, trained = self._update(a, transitions, plan, t0), bool(plan.order)
        else:
            if not transitions:
                raise ValueError("GRPOTrainer.step: empty batch, no transitions to train on")
            m, trained = _rollout_means(transitions), False
            for a in self.adapters.values():
                self.model.set_adapter(a.name)
                mine = [t for t in transitions if t.component in a.components]
                plan = self._prepare(transitions, scored, a.components, masks=masks)
                trained |= bool(plan.order)
                m.update({f"{a.name}.{k}": v for k, v in self._update(a, mine, plan, t0).items()
                          if k not in ("step", "seconds")})
        m.update(num_constrained=float(len(masks)), constraint_mismatch=float(mismatched))
        if not trained:  # nothing left to learn from: no update, not an error
            return {**m, "step": float(self.global_step), "seconds": time.perf_counter() - t0}
        self.model.eval()
        self.global_step += 1
        if self.device.startswith("cuda"):
            # Hand the allocator's cached blocks back, so a sleeping inference server on this GPU can wake into them.
            torch.cuda.empty_cache()
        return {**m, "step": float(self.global_step), "seconds": time.perf_counter() - t0}

    def _update(self, a: _Adapter, transitions: Sequence[Transition], plan: _Plan, t0: float) -> dict[str, float]:
        """`a`'s update over its plan (its adapter the active one)."""
        cfg = self.config
        if not plan.order:  # nothing left to learn from: no update, not an error
            self._advance_schedule(cfg.epochs, a)  # the schedule's horizon counts these steps: it must end on time
            return self._metrics(transitions, plan, Counter(), t0, a)
        clean, refs = self._frozen_logprobs(plan.batches)
        # The old policy of the ratio: with several epochs the dropout-free pass; with one, epoch 0's own log-probs
        # (its ratio exactly 1, the gradient the same). The importance weight and the gap always compare the
        # sampler with the dropout-free policy: dropout noise is no mismatch.
        olds = list(clean) if cfg.epochs > 1 else [None] * len(plan.batches)
        self.model.train()
        totals: Counter[str] = Counter()
        for epoch in range(cfg.epochs):
            a.optimizer.zero_grad(set_to_none=True)
            for i, (b, ref) in enumerate(zip(plan.batches, refs)):
                logits = self._logits(b)
                logp = _gather(logits, b)
                if olds[i] is None:  # epoch 0 without a separate pass: this is the old policy
                    olds[i] = logp.detach()
                if clean[i] is None:  # no dropout: epoch 0's pass is the dropout-free one
                    clean[i] = logp.detach()
                if epoch == 0:  # no update yet: the policy the sampler ran, so compare with its log-probs
                    totals.update(_sampler_gap(clean[i], b))
                    with torch.no_grad():  # weighted like the loss: the mean entropy per trained token
                        totals["entropy_sum"] += (b.weights[_trained(b)] * entropy(logits)).sum().item()
                        totals["weight_sum"] += b.weights.sum().item()
                del logits
                cap = self.importance_sampling_cap
                is_w = None if cap is None else sampler_is_weight(clean[i], b.sampler_logp, b.has_sampler_logp, cap)
                if is_w is not None:  # the share of trained tokens whose weight the cap cut (weighted like the loss)
                    totals["is_capped_frac"] += (b.weights * (is_w >= cap)).sum().item()
                loss, st = grpo_loss(logp, olds[i], b.adv, b.weights, clip_eps=cfg.clip_eps,
                                     clip_eps_high=cfg.clip_eps_high, ref_logp=ref, beta=cfg.beta, is_weight=is_w,
                                     log_ratio_clamp=cfg.log_ratio_clamp, dual_clip=cfg.dual_clip,
                                     level=cfg.importance_sampling_level, segments=b.segments)
                loss.backward()  # weights sum to 1 over the whole batch: accumulated grads == full-batch grads
                totals.update({"loss": loss.item(), **{k: v.item() for k, v in st.items()}})
            self.ranks.sum_grads(a.params)  # the whole batch's gradient in every process: they all step alike
            norm = float(torch.nn.utils.clip_grad_norm_(a.params, cfg.max_grad_norm))
            totals["lr"] += a.optimizer.param_groups[0]["lr"]
            if math.isfinite(norm):
                totals["grad_norm"] += norm
                a.optimizer.step()
            else:  # a nan/inf gradient would make every adapter tensor (and Adam's moments) non-finite at once
                totals["skipped_steps"] += 1
                log.warning("update %d, epoch %d: gradient norm is %s; optimizer step skipped (train.skipped_steps)",
                            self.global_step + 1, epoch, norm)
            a.optimizer.zero_grad(set_to_none=True)
            self._advance_schedule(1, a)
        # Sums over micro-batches, over every process's; the step's own figures are the same in each.
        totals = self.ranks.sum_counts(totals, same=("lr", "grad_norm", "skipped_steps"))
        return self._metrics(transitions, plan, totals, t0, a)

    def _advance_schedule(self, steps: int, a: _Adapter | None = None) -> None:
        """The learning-rate schedule moves on by `steps` optimizer steps, taken or not (skipped, nothing to
        train), so it ends when the run does."""
        with warnings.catch_warnings():  # torch's "scheduler.step() before optimizer.step()": deliberate here
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*", category=UserWarning)
            for adapter in [a] if a is not None else self.adapters.values():
                for _ in range(steps):
                    adapter.scheduler.step()

    def _replay(self, transitions: Sequence[Transition]) -> tuple[list[Transition], dict[str, torch.Tensor], int]:
        """Each constrained call's grammar replayed over its completion ids: span id -> [C, words] bitmask of the
        tokens allowed at each position. A call whose ids the grammar does not accept was not sampled under it
        (a server that applied another grammar, or none): it is left out, and counted (constraint_mismatch).
        Each is replayed as its record says the server applied it (its tool-call parser, reasoning parser and
        argument whitespace); a record that does not say (an older store) as this run's backend applied it then
        (unsaid_server)."""
        constrained = [t for t in transitions if t.constraint]
        if not constrained:
            return list(transitions), {}, 0
        if self._grammars is None:
            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            tokenizer = models.load_tokenizer(self._model_path)
            self._unsaid = unsaid_server(self._backend, self._model_path)
            self._grammars = Grammars(tokenizer, vocab, models.eos_ids(self.model, tokenizer), server=self._unsaid)
            self._think = ThinkTokens.of(tokenizer)
        masks, bad = {}, set()
        for t in constrained:
            try:
                c = Constraint.from_json(t.constraint)
                think = self._think if (c.server or self._unsaid).reasoning_parser == "qwen3" else None
                start = think.grammar_start(t.prompt_ids, t.completion_ids) if think else 0
                m = self._grammars.replay(c, t.completion_ids, start)
            except (ConstraintError, ValueError):
                m = None
            if m is None:
                bad.add(t.span_id)
            else:
                masks[t.span_id] = m
        if bad:
            log.warning("%d constrained call(s) left out of this update: their completion ids are not what the "
                        "recorded constraint allows (train.constraint_mismatch)", len(bad))
        return [t for t in transitions if t.span_id not in bad], masks, len(bad)

    def _prepare(self, transitions: Sequence[Transition], scored: GroupOutcomes | None,
                 components: Sequence[str] = (), *, masks: dict[str, torch.Tensor] | None = None,
                 given: dict[tuple[str, str], float] | None = None) -> _Plan:
        """Advantages and token weights over the whole batch, then micro-batches of similar lengths (less padding).
        With `components` (one policy's), the plan holds only their calls, with the advantages of the whole batch.

        Groups with a single rollout have no baseline and are left out (counted in num_skipped), and so are groups
        whose outcomes are all equal when train.drop_zero_variance_groups is set; transitions with empty
        completions, or cut by max_tokens under train.mask_truncated, have no tokens to train.
        """
        cfg = self.config
        if not transitions:
            raise ValueError("GRPOTrainer.step: empty batch, no transitions to train on")
        if given is not None:  # made elsewhere: every transition kept, with its own advantage
            ts, frac, values = list(transitions), 0.0, [given[(t.rollout_id, t.span_id)] for t in transitions]
        else:
            b = batch_advantages([t.outcome for t in transitions], [t.group_id for t in transitions],
                                 [t.rollout_id for t in transitions], cfg.scale_rewards,
                                 credit=[t.credit for t in transitions], shaping=[t.shaping for t in transitions],
                                 scored=scored, drop_zero_variance=cfg.drop_zero_variance_groups)
            ts, frac, values = [transitions[i] for i in b.kept], b.zero_variance_frac, [a.value for a in b.advantages]
        args = ([t.outcome for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts])
        masked = [cfg.mask_truncated and t.finish_reason == "length" for t in ts]
        n = [0 if m else len(t.completion_ids) for t, m in zip(ts, masked)]
        if not any(n):
            return _Plan(ts, torch.zeros(len(ts)), frac, sum(masked), [], [])
        adv = torch.tensor(values, dtype=torch.float64).float()
        if components:
            keep = [i for i, t in enumerate(ts) if t.component in components]
            ts, adv, masked, n = [ts[i] for i in keep], adv[keep], [masked[i] for i in keep], [n[i] for i in keep]
            args = ([t.outcome for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts])
            if not any(n):
                return _Plan(ts, adv, frac, sum(masked), [], [])
        order = [i for i in range(len(ts)) if n[i]]
        # Weights per transition, before packing: a packed row's calls count exactly the tokens they did as rows.
        w = token_weights(n, args[2], cfg.loss_norm, max_completion_length=cfg.max_completion_length,
                          group_ids=args[1])
        rows = pack(ts, [k > 0 for k in n]) if cfg.pack_calls else [single(ts, i) for i in order]
        if cfg.pack_calls and self.head.shared_prompt_reason is None:
            rows = share(rows, ts, cfg.micro_batch_size)
        rows.sort(key=lambda r: r.length)  # similar lengths together: less padding
        mine = self.ranks.share(rows)
        # A pass reads at most what micro_batch_size rows of the longest call would (padding included), so packing
        # never raises the memory bound micro_batch_size sets.
        longest = max(len(ts[i].prompt_ids) + len(ts[i].completion_ids) for i in order)
        batches = [collate(c, ts, adv, w, self.device, masks)
                   for c in split(mine, cfg.micro_batch_size, cfg.micro_batch_size * longest)]
        for _ in range(self.ranks.lockstep(len(batches)) - len(batches)):  # passes that weigh 0 (data_parallel)
            b = collate(rows[:1], ts, adv, w, self.device, masks)
            batches.append(replace(b, weights=torch.zeros_like(b.weights),
                                   has_sampler_logp=torch.zeros_like(b.has_sampler_logp)))
        return _Plan(ts, adv, frac, sum(masked), order, batches, sum(r.length for r in rows))

    def _frozen_logprobs(self, batches: list[Batch]) -> tuple[list, list]:
        """The policy's dropout-free log-probs before this update, and the reference's, each computed only when
        needed ([None] * n otherwise).

        Without dropout a training-mode pass computes the dropout-free log-probs itself: epoch 0's serve (its ratio
        exp(logp - logp.detach()) = 1 with the same gradient, and the old policy of later epochs). Only a model with
        dropout (train-mode log-probs differ) pays for a separate no-grad pass, whatever the number of epochs: the
        sampler's tokens are weighed against it.
        """
        cfg, none = self.config, [None] * len(batches)
        clean = self._logprobs_frozen(batches, reference=False) if not self._train_forward_is_eval else list(none)
        refs = self._logprobs_frozen(batches, reference=True) if cfg.beta > 0 else none
        return clean, refs

    def _metrics(self, transitions: Sequence[Transition], plan: _Plan, totals: Counter, t0: float,
                 a: _Adapter) -> dict[str, float]:
        """Loss statistics averaged over epochs (grad_norm over the steps taken; skipped_steps counts the steps left
        out for a non-finite gradient); logprob_gap is the mean |trainer - sampler| log-prob before the update (the
        train/inference mismatch)."""
        m = {**_EMPTY_METRICS, **_rollout_means(transitions),
             "num_skipped": float(len(transitions) - len(plan.ts)), "zero_variance_frac": plan.zero_variance_frac,
             "num_masked_truncated": float(plan.num_masked)}
        if plan.order:  # an lr only where a step used it
            m["lr"] = a.optimizer.param_groups[0]["lr"]
            gap, gap_n = totals.pop("gap", 0.0), totals.pop("gap_n", 0)
            ent, ent_w = totals.pop("entropy_sum", 0.0), totals.pop("weight_sum", 0.0)
            m["entropy"] = ent / ent_w if ent_w else math.nan
            kept = plan.adv[plan.order]
            skipped = totals.pop("skipped_steps", 0)
            stepped = self.config.epochs - skipped
            m["grad_norm"] = totals.pop("grad_norm", 0.0) / stepped if stepped else math.nan
            m.update({k: v / self.config.epochs for k, v in totals.items()}, skipped_steps=float(skipped))
            m.update(adv_mean=kept.mean().item(), adv_std=kept.std().item() if len(plan.order) > 1 else 0.0,
                     num_transitions=float(len(plan.order)),
                     num_tokens=float(sum(len(plan.ts[i].completion_ids) for i in plan.order)),
                     # every token a forward pass reads (packed calls read their shared prefix once): what the
                     # update's FLOPs scale with
                     num_input_tokens=float(plan.read_tokens),
                     logprob_gap=gap / gap_n if gap_n else math.nan)
        if self.device.startswith("cuda"):  # this process's peak so far, in bytes
            m["max_memory_allocated"] = float(torch.cuda.max_memory_allocated(self.device))
        return {**m, "step": float(self.global_step), "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------------- checkpoints

    def save_adapter(self, path: str | Path) -> None:
        """A PEFT adapter dir (adapter_config.json + adapter_model.safetensors) for PeftModel.from_pretrained; with
        several policies, one such dir per policy under `path`. Every process calls it; process 0 writes."""
        state = self._adapter_state()
        if self.ranks.rank == 0:
            with atomic_dir(path) as tmp:
                self._save_adapters(tmp, state)

    def _named(self, a: _Adapter) -> list[tuple[str, torch.nn.Parameter]]:
        """`a`'s parameters by name (the model's own names, e.g. `...lora_A.default.weight`): the ones its optimizer
        steps, whatever requires_grad says now (peft's disable_adapter flips it)."""
        mine = {id(p) for p in a.params}
        return [(n, p) for n, p in self.model.named_parameters() if id(p) in mine]

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """Every adapter's parameters by name, whole (gathered where sharded: every process calls this)."""
        return {n: self.ranks.whole(p) for a in self.adapters.values() for n, p in self._named(a)}

    def _save_adapters(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        # An adapter with a nan or inf is never written, so it is never served or published either.
        bad = first_nonfinite(state.items())
        if bad is not None:
            raise RunError(f"the adapter after update {self.global_step} holds nan or inf (first in {bad}); it is "
                           f"not saved, served or published. The previous checkpoint is intact: lower train.lr "
                           f"or train.max_grad_norm and --resume")
        # The adapter only: with lm_head targeted peft would also copy the frozen head (vocab x hidden), which
        # the base model already has. peft writes a named adapter to `path/<name>/`.
        self.model.save_pretrained(path, save_embedding_layers=False, state_dict=state,
                                   **({"selected_adapters": list(self.adapters)} if self._multi else {}))

    def _files(self, path: Path, a: _Adapter) -> tuple[Path, Path, Path]:
        """Where `a`'s adapter, optimizer and scheduler state live in a trainer checkpoint."""
        if not self._multi:
            return path / ADAPTER, path / "optimizer.pt", path / "scheduler.pt"
        return path / ADAPTERS / a.name, path / f"optimizer-{a.name}.pt", path / f"scheduler-{a.name}.pt"

    def save_state(self, path: str | Path) -> None:
        """Everything needed to resume: adapters, optimizers, step counter, RNG. Appears only once complete. Every
        process calls it (a sharded adapter and its optimizer state are gathered first); process 0 writes."""
        state = self._adapter_state()
        optimizers = {a.name: self._optimizer_state(a) for a in self.adapters.values()}
        if self.ranks.rank != 0:
            return
        with atomic_dir(path) as tmp:
            self._save_adapters(tmp / ADAPTERS if self._multi else tmp / ADAPTER, state)
            for a in self.adapters.values():
                _, opt, sched = self._files(tmp, a)
                torch.save(optimizers[a.name], opt)
                torch.save(a.scheduler.state_dict(), sched)
            # Not Python's `random`: the trainer does not draw from it, and restoring it on resume replayed the
            # span ids OpenTelemetry draws from it. (Older checkpoints' "python" entry is ignored on load.)
            rng = {"torch": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
            torch.save(rng, tmp / "rng.pt")
            shape = {a.name: {k: getattr(a.config, k) for k in ADAPTER_SHAPE} for a in self.adapters.values()}
            state = {"global_step": self.global_step,
                     **({"policies": shape} if self._multi else {"adapter": shape["default"]})}
            (tmp / "trainer_state.json").write_text(json.dumps(state))

    def _optimizer_state(self, a: _Adapter) -> dict:
        """`a`'s optimizer state as one process holds it, whole (the same file whatever train.shard wrote it)."""
        sd = a.optimizer.state_dict()
        sd["state"] = {i: {k: self.ranks.whole(v) if torch.is_tensor(v) else v for k, v in st.items()}
                       for i, st in sd["state"].items()}
        return sd

    def _load_optimizer_state(self, a: _Adapter, sd: dict) -> None:
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = dict(zip(ids, (p for g in a.optimizer.param_groups for p in g["params"])))
        sd["state"] = {i: {k: self.ranks.part(params[i], v) if torch.is_tensor(v) and v.dim() else v
                           for k, v in st.items()} for i, st in sd["state"].items()}
        a.optimizer.load_state_dict(sd)

    def _load_adapter(self, a: _Adapter, weights: dict[str, torch.Tensor], path: Path) -> None:
        """`a`'s parameters from a peft adapter file's `weights` (each process its shard of them)."""
        from peft.utils import get_peft_model_state_dict

        named = self._named(a)
        # peft's names in the file for the model's parameters: the same objects under the names it saves them by.
        saved = get_peft_model_state_dict(self.model, state_dict=dict(named), adapter_name=a.name,
                                          save_embedding_layers=False)
        key = {id(p): k for k, p in saved.items()}
        missing = [n for n, p in named if key.get(id(p)) not in weights]
        if missing:
            raise ValueError(f"{path}: adapter does not match this model (missing {missing[:3]}...)")
        with torch.no_grad():
            for _, p in named:
                p.copy_(self.ranks.part(p, weights[key[id(p)]]))

    def load_state(self, path: str | Path) -> None:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "trainer_state.json").exists():
            raise FileNotFoundError(f"{path}: not a trainer checkpoint (no trainer_state.json)")
        global_step = json.loads((path / "trainer_state.json").read_text())["global_step"]
        for a in self.adapters.values():
            adapter, opt, sched = self._files(path, a)
            self._load_adapter(a, load_file(adapter / "adapter_model.safetensors", device=self.device), path)
            self._load_optimizer_state(a, torch.load(opt, map_location=self.device))
            saved_lr = a.optimizer.param_groups[0].get("initial_lr", a.optimizer.param_groups[0]["lr"])
            if sched.exists():
                a.scheduler.load_state_dict(torch.load(sched))
            else:  # a checkpoint without one: its position from the updates made, not warmup again from 0
                self._advance_schedule(global_step * self.config.epochs, a)
            self._apply_config_over_checkpoint(saved_lr, a)
        rng = torch.load(path / "rng.pt")
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.global_step = global_step
        self.ranks.broadcast(self._all_params())

    def _all_params(self) -> list[torch.nn.Parameter]:
        return [p for a in self.adapters.values() for p in a.params]

    def _apply_config_over_checkpoint(self, saved_lr: float, a: _Adapter) -> None:
        """train.lr and train.weight_decay as configured now, not as the checkpoint's optimizer state has them
        (a documented override, logged): the schedule keeps its place, scaled to the new peak."""
        cfg, lr = self.config, a.config.lr
        key = f"policies.{a.name}.lr" if self._multi else "train.lr"
        for g in a.optimizer.param_groups:
            if g["weight_decay"] != cfg.weight_decay:
                log.warning("resume: train.weight_decay = %g applies from here (the checkpoint's was %g)",
                            cfg.weight_decay, g["weight_decay"])
                g["weight_decay"] = cfg.weight_decay
            if saved_lr != lr:
                g["lr"] *= lr / saved_lr
                g["initial_lr"] = lr
        if saved_lr != lr:
            a.scheduler.base_lrs = [lr] * len(a.optimizer.param_groups)
            log.warning("resume: %s = %g applies from here (the checkpoint's was %g)", key, lr, saved_lr)


# What the adapter's weights mean: a checkpoint made with other values cannot continue under these.
ADAPTER_SHAPE = ("lora_r", "lora_alpha", "target_modules")


def checkpoint_conflict(path: str | Path, config: TrainConfig, policies: Sequence[Policy] | None = None) -> str | None:
    """Why the trainer checkpoint at `path` cannot resume under `config` and `policies` (a changed ADAPTER_SHAPE
    key would load the adapter and silently move the policy; another set of policies has other adapters), naming
    the key; None when it can."""
    path = Path(path)
    state = json.loads((path / "trainer_state.json").read_text())
    new = "start a new run (--run-dir, --overwrite)"
    if ("policies" in state) != (policies is not None):
        return (f"policies: the checkpoint {path.parent.name} was trained "
                + (f"with [policies] {sorted(state['policies'])}, and the config has none" if "policies" in state
                   else "as one policy, and the config has [policies]")
                + f": its adapters do not match; restore the config's policies to resume, or {new}")
    if policies is not None:
        saved_set, names = state["policies"], [p.name for p in policies]
        if sorted(saved_set) != sorted(names):
            return (f"policies: the checkpoint {path.parent.name} holds {sorted(saved_set)}, the config names "
                    f"{sorted(names)}: restore them to resume, or {new}")
        for p in policies:
            for key, value in saved_set[p.name].items():
                if getattr(p.train, key) != value:
                    return (f"policies.{p.name}.{key} = {getattr(p.train, key)!r}, but the checkpoint "
                            f"{path.parent.name} trained it with {value!r}: its adapter means something else under "
                            f"the new value. Set it back to resume, or {new}")
        return None
    saved = state.get("adapter")
    if saved is None:  # a checkpoint without the record: what peft's adapter_config.json says
        peft = json.loads((path / ADAPTER / "adapter_config.json").read_text())
        saved = {"lora_r": peft.get("r"), "lora_alpha": peft.get("lora_alpha")}
    for key, value in saved.items():
        if getattr(config, key) != value:
            return (f"train.{key} = {getattr(config, key)!r}, but the checkpoint {path.parent.name} was trained with "
                    f"{value!r}: its adapter means something else under the new value. Set train.{key} = "
                    f"{value!r} to resume, or start a new run (--run-dir, --overwrite)")
    return None


def _adapter_params(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """The LoRA parameters of peft adapter `name` (`...lora_A.<name>.weight`); peft makes only the active
    adapter's trainable (`set_adapter`), so they are found by name."""
    out = []
    for n, p in model.named_parameters():
        parts = n.split(".")
        if any(a.startswith("lora_") and b == name for a, b in zip(parts, parts[1:])):
            out.append(p)
    return out


def _rollout_means(ts: Sequence[Transition]) -> dict[str, float]:
    """episode_reward_mean: the mean outcome with every rollout counted once (failed rollouts trained at
    rollout.failed_reward included, so it can differ from the runtime's reward_mean over succeeded rollouts);
    shaping_mean: the mean over rollouts of the intermediate rewards credited to their calls."""
    outcome: dict[str, float] = {}
    shaping: dict[str, float] = defaultdict(float)
    for t in ts:
        outcome[t.rollout_id] = t.outcome
        shaping[t.rollout_id] += t.shaping
    if not outcome:  # a policy none of whose components was called
        return {"episode_reward_mean": math.nan, "shaping_mean": math.nan}
    return {"episode_reward_mean": sum(outcome.values()) / len(outcome),
            "shaping_mean": sum(shaping.values()) / len(outcome)}


def _trained(b: Batch) -> torch.Tensor:
    """[B, C] bool: the tokens the loss reads (weight > 0; the sampler's log-probs are kept only there)."""
    return b.weights > 0


def _gather(logits: torch.Tensor, b: Batch) -> torch.Tensor:
    """[B, C] log-probs of the targets from _logits' [N, V], 0 at the untrained tokens (weight 0 in every sum)."""
    keep = _trained(b)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, b.targets[keep].unsqueeze(-1)).squeeze(-1)
    return logp.new_zeros(keep.shape).masked_scatter(keep, logp)


def _lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int | None):
    """train.warmup_steps of linear warmup from 0, then train.lr_schedule (transformers' schedulers, as TRL's
    lr_scheduler_type / warmup_steps); one scheduler step per optimizer step."""
    from transformers import get_scheduler

    if cfg.lr_schedule != "constant" and total_steps is None:
        raise ValueError(f"train.lr_schedule = {cfg.lr_schedule!r} needs the run's total optimizer steps")
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)


def _sampler_gap(logp: torch.Tensor, b: Batch) -> dict[str, float]:
    """Sum and count of |trainer - sampler| log-prob over the tokens the sampler reported."""
    return {"gap": ((logp.detach() - b.sampler_logp).abs() * b.has_sampler_logp).sum().item(),
            "gap_n": int(b.has_sampler_logp.sum())}
