"""How the update's time and memory grow with the context, on a real family's shape: rows apart, the dense mask,
the shared prompt (the trainer's attention, train/attention.py).

    python benchmarks/scale.py                        # contexts 1k, 4k, 8k, 16k; checkpointing off and on
    python benchmarks/scale.py --context 16384        # the same, up to 16k; ends with the `scale:` line
    python benchmarks/scale.py --model shape:qwen2.5-1.5b@2 --contexts 2048 8192 --branches 8

The batch is one GRPO group: `--branches` rollouts of one call each, sharing a prompt so that each call is
`context` tokens (prompt + `--completion` sampled tokens), rewards 0 and 1 alternating. Each point is a fresh
subprocess (large allocations mmapped, so the peak counts tensors, not reused heap): the trainer (LoRA r 16 on
every linear layer, the run's default micro_batch_size, float32 on the CPU) takes one update of the batch three ways:
  apart   train.pack_calls = false: one row per call, through the trainer's attention (causal, no mask)
  dense   the rows merged as branches of the prompt, read through one [L, L] mask per row with the model's own
          sdpa attention (what the trainer did before train/attention.py)
  shared  the rows merged as branches, the prompt read once, no [L, L] mask: the default, which takes the dense
          mask instead only for micro-batches of at most train.microbatch.DENSE_UP_TO mask entries (here: up to a
          1k context); this side always takes the shared attention
and reports the update's seconds, tokens per second (the calls' prompt + completion tokens over the seconds: the
same work on every side) and the peak RSS growth over the update (ru_maxrss minus the RSS before it), with gradient
checkpointing off and on. A point whose estimate exceeds `--memory-gb` is skipped and said so. Then a fitted
exponent per side (peak growth ~ context^k, least squares in log-log over the contexts run) and, last, one line:
`scale: context=C shared_peak_mb=X apart_peak_mb=Y dense_peak_mb=Z shared_exponent=K` (the default side: shared,
checkpointing off; at the largest context run).

`--model shape:NAME@LAYERS`: every per-layer cost scales with the depth, so a shallow copy of a real shape keeps
the width, heads, vocabulary and the growth with the context, in less time.

`--others` then runs the curves of the other costs as the work grows, each its own command (and README section):
bytes stored per rollout against its turns and the gateway's time per call as prompts grow to 32k tokens
(store_growth.py), the dashboard and the collector with up to 30,000 rollouts (dashboard_scale.py), and `lightning
serve` over a simulated week (serve_week.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SIDES = ("apart", "dense", "shared")
OTHERS = ("store_growth.py", "dashboard_scale.py", "serve_week.py")


def batch(context: int, branches: int, completion: int, vocab: int) -> list:
    from lightning_sdk.transitions import Transition

    prompt = tuple((7 * i + 3) % (vocab - 10) + 5 for i in range(context - completion))
    out = []
    for b in range(branches):
        ids = tuple((11 * i + 13 * b + 1) % (vocab - 10) + 5 for i in range(completion))
        out.append(Transition(rollout_id=f"r{b}", group_id="g", span_id=f"s{b}", index=0, component=None,
                              prompt_ids=prompt, completion_ids=ids, logprobs=tuple([-2.0] * completion),
                              reward=float(b % 2), episode_reward=float(b % 2)))
    return out


def point(model: str, side: str, context: int, branches: int, completion: int, checkpointing: bool) -> dict:
    """In this (child) process: one update of the group, on `side`."""
    import torch

    from lightning_sdk import models
    from lightning_sdk.config import TrainConfig
    from lightning_sdk.train.trainer import GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    cfg = TrainConfig(lr=1e-5, lora_r=16, lora_alpha=32, target_modules="all-linear", device="cpu",
                      pack_calls=side != "apart", gradient_checkpointing=checkpointing)
    tr = GRPOTrainer(models.resolve(model), cfg, seed=0, dtype="float32")
    if side == "dense":
        _dense(tr)
    from lightning_sdk.train import microbatch

    microbatch.DENSE_UP_TO = 0  # the shared side: train/attention.py's calls at every length
    ts = batch(context, branches, completion, 512)
    rss0 = _rss_kib()
    t0 = time.perf_counter()
    m = tr.step(ts)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    work = sum(len(t.prompt_ids) + len(t.completion_ids) for t in ts)
    return {"seconds": seconds, "tokens_per_s": work / seconds, "peak_mb": (peak - rss0) / 1024,
            "read": m["num_input_tokens"], "grad_norm": m["grad_norm"]}


def _dense(tr) -> None:
    """The trainer as it read shared prompts before train/attention.py: the model's own sdpa attention over one
    [L, L] boolean mask per row (Layout.dense; transformers takes a 4D mask as given)."""
    tr.model.get_base_model().set_attn_implementation("sdpa")
    head = tr.head
    head.shared_prompt_reason = "benchmarked with the dense mask"  # it passes the mask below to the model

    class Dense:
        full_head_reason, shared_prompt_reason = head.full_head_reason, None

        def __call__(self, input_ids, attention_mask, position_ids, rows, cols, layout=None):
            if layout is not None:
                attention_mask = layout.dense(input_ids.shape[1]).to(input_ids.device)
            return head(input_ids, attention_mask, position_ids, rows, cols)

    tr.head = Dense()


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def exponent(xs: list[float], ys: list[float]) -> float:
    """k of y ~ x^k, least squares in log-log."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def estimate_mb(side: str, context: int, branches: int, completion: int, checkpointing: bool, layers: int,
                hidden: int, inter: int) -> float:
    """A rough upper bound of a point's peak growth, to skip the ones that cannot fit: fp32 activations kept per
    token per layer (about 12 hidden + 4 intermediate numbers, 1 hidden with checkpointing plus one layer's whole)
    and, dense, the [L, L] masks."""
    tokens = branches * context if side == "apart" else context + (branches - 1) * completion
    per = 4 * (12 * hidden + 4 * inter)
    acts = tokens * (per * (1 if checkpointing else layers) + (4 * hidden * layers if checkpointing else 0))
    mask = 5 * (context + (branches - 1) * completion) ** 2 * (1 if checkpointing else layers) if side == "dense" else 0
    return (acts + mask) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="shape:qwen2.5-0.5b@2")
    ap.add_argument("--context", type=int, default=16384, help="the largest context run")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--checkpointing", choices=["off", "on", "both"], default="both")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--memory-gb", type=float, default=20.0, help="skip points estimated above this")
    ap.add_argument("--others", action="store_true", help="then run " + ", ".join(OTHERS))
    ap.add_argument("--point", nargs=5, help=argparse.SUPPRESS)  # child: SIDE CONTEXT BRANCHES COMPLETION CKPT
    a = ap.parse_args()
    if a.point:
        side, context, branches, completion, ckpt = a.point
        print(json.dumps(point(a.model, side, int(context), int(branches), int(completion), ckpt == "on")))
        return
    from lightning_sdk import models
    from lightning_sdk.models import shapes

    models.resolve(a.model)  # built once, before the timed children
    c = shapes.config(a.model) if a.model.startswith(shapes.SHAPE) else None
    layers, hidden, inter = ((c.num_hidden_layers, c.hidden_size, c.intermediate_size) if c is not None
                             else (2, 1024, 4096))
    contexts = [n for n in a.contexts if n <= a.context]
    ckpts = {"off": [False], "on": [True], "both": [False, True]}[a.checkpointing]
    print(f"{a.model}: {a.branches} calls sharing a prompt, {a.completion} sampled tokens each; load "
          f"{Path('/proc/loadavg').read_text().split()[0]}")
    print("| context | checkpointing | side | update s | tokens/s | peak RSS growth MB | tokens read | grad norm |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    results: dict[tuple[str, bool], dict[int, dict]] = {}
    # Large blocks straight from mmap, returned when freed: the peak then counts the update's tensors, not heap the
    # model's loading left behind and the update reused (as in benchmarks/activation_bytes.py)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for context in contexts:
        for ckpt in ckpts:
            for side in a.sides:
                est = estimate_mb(side, context, a.branches, a.completion, ckpt, layers, hidden, inter)
                if est > a.memory_gb * 1024:
                    print(f"| {context} | {'on' if ckpt else 'off'} | {side} | skipped: about {est / 1024:.0f} GB "
                          f"(--memory-gb {a.memory_gb:g}) | | | | |")
                    continue
                out = subprocess.run([sys.executable, __file__, "--model", a.model, "--point", side, str(context),
                                      str(a.branches), str(a.completion), "on" if ckpt else "off"],
                                     capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    why = "killed (out of memory?)" if out.returncode < 0 else out.stderr.strip().splitlines()[-1]
                    print(f"| {context} | {'on' if ckpt else 'off'} | {side} | failed: {why} | | | | |")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((side, ckpt), {})[context] = r
                print(f"| {context} | {'on' if ckpt else 'off'} | {side} | {r['seconds']:.2f} | "
                      f"{r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} | {r['read']:.0f} | {r['grad_norm']:.9f} |",
                      flush=True)
    print()
    for (side, ckpt), by in sorted(results.items()):
        xs = sorted(by)
        if len(xs) >= 2:
            k = exponent(xs, [by[x]["peak_mb"] for x in xs])
            t = exponent(xs, [by[x]["seconds"] for x in xs])
            print(f"{side}, checkpointing {'on' if ckpt else 'off'}: peak memory ~ context^{k:.2f}, "
                  f"update seconds ~ context^{t:.2f} over {xs[0]}-{xs[-1]}")
    default = results.get(("shared", False), {})
    top = max(default) if default else None

    def at(side: str) -> str:
        r = results.get((side, False), {}).get(top)
        return "n/a" if r is None else f"{r['peak_mb']:.0f}"

    k = exponent(sorted(default), [default[x]["peak_mb"] for x in sorted(default)]) if len(default) >= 2 else math.nan
    if a.others:
        for other in OTHERS:
            print(f"\n$ python benchmarks/{other}", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).with_name(other))])
    print(f"scale: context={top} shared_peak_mb={at('shared')} apart_peak_mb={at('apart')} "
          f"dense_peak_mb={at('dense')} shared_exponent={k:.2f}")


if __name__ == "__main__":
    main()
