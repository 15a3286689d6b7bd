"""Our GRPO update vs TRL's GRPOTrainer on the same batches: seconds per update and peak RSS.

    pip install -e ".[bench]"
    python benchmarks/trainer_vs_trl.py --updates 5

What each side times: one *update* = training on one collected batch of 16 prompts x 8 completions (128
completions), with the default run's settings (lightning.toml [train]): LoRA r=8 alpha=16 dropout 0 on every
linear layer but lm_head (TRL refuses LoRA on the head; the demo also trains it); 2 epochs over the batch (TRL
num_iterations=2: TRL computes the old policy's log-probs in a separate no-grad pass, ours reuses epoch 0's, the
same values without dropout); micro-batches of 64 (TRL per_device_train_batch_size=64,
gradient_accumulation_steps=2), so 2 AdamW steps per update; lr 2e-3 constant, clip 0.2, beta 0 (no reference
model), group-std scaled advantages, sequence-mean loss (ours "rollout" with one call per rollout == TRL
loss_type "grpo"), fp32, no gradient checkpointing, on the CPU with the same torch thread count.

Generation is not timed on either side: both train on the same fixed completions (random non-special tokens,
lengths drawn in [L/2, L], an <|im_end|> at the end, rewards 0/1), built from a seed in each process.
  ours: `GRPOTrainer.step(transitions)` (advantages, old log-probs, losses, backward, clipping, AdamW).
  TRL:  its whole training step through `Trainer.train` with `rollout_func` returning the fixed completions
        instead of generating (so it tokenizes no prompts, but decodes the completions for its reward
        function and runs the reward function, advantages, loss, backward, clipping, AdamW, and its
        Trainer/accelerate loop), timed from one update boundary to the next by a callback.
The first update of each side is a warm-up and is not counted. Each side runs in its own subprocess (peak RSS is
that process's ru_maxrss, imports included); sides alternate for `--rounds` rounds to cancel drift on a shared
machine. Prints seconds per update and peak RSS of each, and `ratio=<ours/trl>` (seconds per update) last.

Two comparisons (`--variant`, default both):
  product:    each side as it ships, with the default run's 2 epochs: TRL pays a separate old-log-prob pass over
              the batch, ours reuses epoch 0's log-probs (one forward fewer per update).
  equal-work: both sides with 1 epoch (train.epochs = 1, TRL num_iterations = 1), where neither computes old
              log-probs separately (TRL then uses the detached current ones, as ours does): the same forwards,
              backwards and AdamW steps on each side, so the ratio measures the implementations alone.
              Printed as `ratio_equal_work=`.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin:tiny-arith"
PROMPTS, GROUP = 16, 8


def fixed_batches(tok, updates: int, completion_len: int, seed: int) -> list[list[tuple[str, list, list, float]]]:
    """Per update: (question, prompt_ids, completion_ids, reward) for 16 prompts x 8 completions."""
    import json as _json

    tasks = [_json.loads(line) for line in (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()]
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(seed)
    out = []
    for u in range(updates):
        batch = []
        for t in tasks[:PROMPTS]:  # the same prompts each update (TRL samples them from its dataset)
            prompt = list(tok.apply_chat_template([{"role": "user", "content": t["question"]}],
                                                  add_generation_prompt=True, return_dict=True)["input_ids"])
            for _ in range(GROUP):
                n = rng.randint(max(1, completion_len // 2), completion_len) - 1
                batch.append((t["question"], prompt, [rng.choice(vocab) for _ in range(n)] + [end],
                              float(rng.random() < 0.5)))
        out.append(batch)
    return out


def train_config(epochs: int | None = None):
    from lightning_sdk import config

    # TRL refuses LoRA on lm_head (it computes log-probs from lm_head.weight directly): both sides use every
    # linear layer but the head.
    cfg = config.load(ROOT / "lightning.toml").train
    return cfg.model_copy(update={"device": "cpu", "target_modules": "all-linear", "epochs": epochs or cfg.epochs})


def run_ours(args) -> list[float]:
    from lightning_sdk import models
    from lightning_sdk.transitions import Transition
    from lightning_sdk.train.trainer import GRPOTrainer

    path = models.resolve(MODEL)
    batches = fixed_batches(models.load_tokenizer(path), args.updates + 1, args.completion_len, args.seed)
    trainer = GRPOTrainer(path, train_config(args.epochs), dtype="float32", seed=args.seed)
    times = []
    for u, batch in enumerate(batches):
        ts = [Transition(f"u{u}-r{k}", f"u{u}-{q}", f"s{k}", 0, None, tuple(p), tuple(c), None, r)
              for k, (q, p, c, r) in enumerate(batch)]
        t0 = time.perf_counter()
        trainer.step(ts)
        times.append(time.perf_counter() - t0)
    return times[1:]


def run_trl(args) -> list[float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_sdk import models
    from lightning_sdk.train.trainer import lora_targets

    path = models.resolve(MODEL)
    tok = models.load_tokenizer(path)
    batches = fixed_batches(tok, args.updates + 1, args.completion_len, args.seed)
    cfg = train_config(args.epochs)
    model = models.load_causal_lm(path, dtype="float32")
    torch.manual_seed(args.seed)
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(model, cfg.target_modules), task_type="CAUSAL_LM")
    micro = cfg.micro_batch_size
    accumulation = PROMPTS * GROUP // micro
    steps_per_update = cfg.epochs  # optimizer steps on one generation batch

    # The completions of update u, in the order TRL asks for them (its sampler shuffles the prompts).
    served = {"calls": 0}
    rewards: dict[tuple, float] = {}

    def rollout_func(prompts, trainer):
        batch = batches[served["calls"]]
        served["calls"] += 1
        pool: dict[str, list] = {}
        for q, p, c, r in batch:
            pool.setdefault(q, []).append((p, c))
            rewards[(q, tuple(c))] = r
        picked = [pool[m[-1]["content"]].pop() for m in prompts]
        return {"prompt_ids": [p for p, _ in picked], "completion_ids": [c for _, c in picked],
                "logprobs": [[0.0] * len(c) for _, c in picked]}

    def reward(prompts, completions, completion_ids, **kwargs):
        return [rewards[(p[-1]["content"], tuple(c))] for p, c in zip(prompts, completion_ids)]

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step % steps_per_update == 0:
                marks.append(time.perf_counter())

    args_trl = GRPOConfig(
        output_dir=str(Path(args.tmp) / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=GROUP, num_iterations=cfg.epochs,
        max_steps=(args.updates + 1) * steps_per_update, max_completion_length=args.completion_len,
        learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.weight_decay,
        optim="adamw_torch", max_grad_norm=cfg.max_grad_norm, beta=cfg.beta, epsilon=cfg.clip_eps,
        loss_type="grpo", scale_rewards="group", temperature=1.0, report_to="none", save_strategy="no",
        logging_steps=10_000, disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]}
                                 for q in dict.fromkeys(q for q, *_ in batches[0])])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args_trl, train_dataset=dataset,
                          processing_class=tok, peft_config=lora, rollout_func=rollout_func, callbacks=[Clock()])
    trainer.train()
    return [b - a for a, b in zip(marks, marks[1:])]  # the first update (warm-up) ends at marks[0]


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    times = run_ours(args) if args.side == "ours" else run_trl(args)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"times": times, "rss_mb": rss_mb}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=5, help="timed updates per side and round (plus one warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="ours, trl, ours, trl, ... alternating")
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", choices=["product", "equal-work", "both"], default="both")
    p.add_argument("--epochs", type=int, default=None, help=argparse.SUPPRESS)  # None: lightning.toml's
    p.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="/tmp/ls-trl-bench", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        return child(args)
    variants = {"product": None, "equal-work": 1}
    ratios = {}
    for name, epochs in variants.items():
        if args.variant in (name, "both"):
            ratios[name] = compare(args, name, epochs)
    if "equal-work" in ratios:
        print(f"ratio_equal_work={ratios['equal-work']:.3f}")
    if "product" in ratios:
        print(f"ratio={ratios['product']:.3f}")


def compare(args, name: str, epochs: int | None) -> float:
    """One comparison, sides alternating for args.rounds rounds; returns ours/trl seconds per update."""
    times: dict[str, list[float]] = {"ours": [], "trl": []}
    rss: dict[str, float] = {"ours": 0.0, "trl": 0.0}
    for _ in range(args.rounds):
        for side in ("ours", "trl"):
            cmd = [sys.executable, __file__, "--side", side, "--updates", str(args.updates), "--completion-len",
                   str(args.completion_len), "--threads", str(args.threads), "--seed", str(args.seed)]
            cmd += ["--epochs", str(epochs)] if epochs else []
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode or line is None:
                raise SystemExit(f"{side} failed ({out.returncode}):\n{out.stderr[-3000:]}")
            res = json.loads(line[len("RESULT "):])
            times[side] += res["times"]
            rss[side] = max(rss[side], res["rss_mb"])
            print(f"[{name}] {side}: {statistics.mean(res['times']):.3f} s/update over {len(res['times'])} "
                  f"updates, peak RSS {res['rss_mb']:.0f} MB", flush=True)
    ours, trl = statistics.mean(times["ours"]), statistics.mean(times["trl"])
    print(f"[{name}] ours: {ours:.3f} s/update (median {statistics.median(times['ours']):.3f}), "
          f"peak RSS {rss['ours']:.0f} MB")
    print(f"[{name}] trl:  {trl:.3f} s/update (median {statistics.median(times['trl']):.3f}), "
          f"peak RSS {rss['trl']:.0f} MB")
    print(f"[{name}] {PROMPTS}x{GROUP} completions of <= {args.completion_len} tokens per update, "
          f"{args.updates} timed updates x {args.rounds} rounds per side, {args.threads} torch thread(s), "
          f"epochs {epochs or train_config().epochs}")
    return ours / trl

if __name__ == "__main__":
    main()
