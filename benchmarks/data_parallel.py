"""A data-parallel update (train.processes = N) against one process, on the same batches, in the same run.

    python benchmarks/data_parallel.py                    # the CPU: 2 gloo processes vs 1, the tiny model
    python benchmarks/data_parallel.py --device cuda --processes 4 --model DIR   # N GPUs vs 1 (gpu_proof.sh --gpus)
    python benchmarks/data_parallel.py --shard none fsdp  # also N processes with the base sharded (train.shard)

One update = GRPOTrainer.step on a fixed batch of `--prompts` x `--group` random completions (lengths in [L/2, L]),
rewards 0/1, one epoch, LoRA on every linear layer. One process runs in this interpreter with every thread this
process has (or on GPU 0); the N processes are the run's own (train.ranks.TrainerProcesses), those threads shared
between them (or one GPU each), once per `--shard` value. The first update of each is a warm-up. Prints seconds per
update of each, the base parameters each process holds, `loadavg` at the time and `speedup=<one / N>` last (N
processes with the first `--shard` value).

On a CPU the N processes share the cores one process already used: the arithmetic is the same, split, plus one
all-reduce of the adapter's gradients, so the ratio stays near 1 there; it measures the mechanics, not a gain.
Compare with `--threads 1` on a shared machine: a torch pool of several threads on busy cores waits at every op's
barrier for a thread that has no core, which slows the one process far more than N single-threaded ones and reads
as a speed-up that is not data parallelism's. GPUs, each with its own memory and compute, are where it pays.
train.shard = 'fsdp' adds, to every forward and backward pass, an all-gather of each layer's weights (and a
reduce-scatter of the adapter's gradients): it buys memory, never speed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fixed_batch(model_path: str, prompts: int, group: int, length: int, seed: int = 0) -> list:
    from lightning_sdk import models
    from lightning_sdk.transitions import Transition

    tok = models.load_tokenizer(model_path)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        prompt = tuple(rng.choice(vocab) for _ in range(32))
        for g in range(group):
            completion = tuple(rng.choice(vocab) for _ in range(rng.randint(length // 2, length)))
            rid = f"p{p}g{g}"
            out.append(Transition(rid, f"p{p}", f"{rid}.0", 0, None, prompt, completion, None,
                                  float(rng.random() < 0.5), 1.0))
    return out


def timed(trainer, batch: list, updates: int) -> list[float]:
    trainer.step(batch)  # warm-up
    times = []
    for _ in range(updates):
        t = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - t)
    return times


def compare(model_path: str, processes: int, device: str, *, updates: int, prompts: int, group: int, length: int,
            micro_batch_size: int, threads: int | None = None, shards: tuple[str, ...] = ("none",)) -> dict:
    """Seconds per update of one process ('one_s') and of `processes` with each train.shard of `shards`
    ('<shard>_s'; 'n_s' the first's), the base parameters each of those processes held ('<shard>_held') and the
    update's input tokens."""
    import torch

    from lightning_sdk.config import TrainConfig
    from lightning_sdk.train.ranks import TrainerProcesses
    from lightning_sdk.train.trainer import GRPOTrainer

    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    batch = fixed_batch(model_path, prompts, group, length)
    settings = dict(device=device, micro_batch_size=micro_batch_size, lora_r=16, lora_alpha=32,
                    target_modules="all-linear", gradient_checkpointing=device != "cpu")
    dtype = "float32" if device == "cpu" else "bfloat16"
    one = GRPOTrainer(model_path, TrainConfig(**settings), seed=0, dtype=dtype)
    single = timed(one, batch, updates)
    del one
    if device != "cpu":
        torch.cuda.empty_cache()
    out = {"one_s": statistics.median(single),
           "tokens": float(sum(len(t.prompt_ids) + len(t.completion_ids) for t in batch))}
    for shard in shards:
        with TrainerProcesses(model_path, TrainConfig(processes=processes, shard=shard, **settings), threads=threads,
                              seed=0, dtype=dtype) as ranks:
            out[f"{shard}_s"] = statistics.median(timed(ranks, batch, updates))
            out[f"{shard}_held"] = [h["held"] for h in ranks.held_parameters()]
    out["n_s"] = out[f"{shards[0]}_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-arith")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--shard", nargs="+", default=["none"], choices=["none", "fsdp"],
                   help="train.shard of the N processes, each measured in turn")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the one process (default torch's); "
                   "the N processes share them, at least 1 each")
    args = p.parse_args()
    from lightning_sdk import models

    path = models.resolve(args.model)
    r = compare(path, args.processes, args.device, updates=args.updates, prompts=args.prompts, group=args.group,
                length=args.length, micro_batch_size=args.micro_batch_size, threads=args.threads,
                shards=tuple(args.shard))
    load = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"
    each = " | ".join(f"{args.processes} processes, train.shard = {s}: {r[f'{s}_s']:.3f} s/update "
                      f"(one/this {r['one_s'] / r[f'{s}_s']:.3f}), base parameters held {r[f'{s}_held']}"
                      for s in args.shard)
    print(f"one process ({args.threads or 'default'} threads): {r['one_s']:.3f} s/update | {each} | "
          f"{r['tokens']:.0f} tokens/update | loadavg {load}")
    print(f"speedup={r['one_s'] / r['n_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
