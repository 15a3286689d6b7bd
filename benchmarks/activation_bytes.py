"""Activation bytes per token per decoder layer of a LoRA update, measured: the constants of lightning_sdk/memory.py.

    python benchmarks/activation_bytes.py            # the table and the fit (about 35 minutes on 2 shared cores)
    python benchmarks/activation_bytes.py --quick    # one model, two contexts: a smoke run
    python benchmarks/activation_bytes.py --head     # the LM head's bytes per logit
    python benchmarks/activation_bytes.py --load F   # the fit of measurements saved with --save F

For each real-shaped model truncated to 1 and 2 decoder layers (`shape:NAME@1`, `@2`: random weights, the real
widths), dtype (fp32, bf16) and gradient checkpointing (off, on: the trainer's non-reentrant way), a fresh
subprocess loads the model with sdpa attention, adds a LoRA (peft, all-linear, r 16), runs one warm-up pass, then,
for each L in turn, ONE row of L tokens (no padding, attention_mask=None) through the decoder, the LM head at 16
positions (the trainer's head runs only at trained tokens) and backward. It records the peak RSS growth over that
pass: the kernel's high-water mark (VmHWM, what ru_maxrss reads) reset to the RSS before the pass
(/proc/self/clear_refs), read after the backward. glibc's mmap threshold is fixed at 64 KiB, so every tensor freed
goes back to the system and each pass starts from the same RSS.

Per (model, dtype, checkpointing) it fits growth = a + b x L at each depth; the per-layer slope is b(2 layers) -
b(1 layer), and the rest of b is what the model holds outside its layers (the embeddings' output, the final norm).
Last it fits the per-layer slope over the models as bytes = c_h x hidden + c_i x intermediate (one pair per dtype
and checkpointing; with checkpointing c_h only: a layer keeps its input), and what lies outside the layers per unit
of hidden, prints those constants beside the ones memory.py holds, and memory.py's estimate of every measured slope.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b")
CONTEXTS = (512, 1024, 2048, 4096)
TRAINED = 16  # positions the head runs at: a few, so the head's logits stay out of the per-token slope


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(model: str, layers: int, dtype: str, checkpointing: bool, contexts: list[int]) -> list[dict]:
    """In this (child) process: the peak RSS growth of one LoRA forward+backward of one row, at each context."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_sdk import models

    torch.set_num_threads(1)
    path = models.resolve(f"shape:{model}@{layers}")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if checkpointing:  # as GRPOTrainer.__init__ does it
        kwargs = {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.config.use_cache = False
    peft = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    peft.train()
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    vocab = base.config.vocab_size

    def step(n: int) -> None:
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n))
        hidden = decoder(input_ids=ids, attention_mask=None, use_cache=False).last_hidden_state
        logits = head(hidden[0, -min(TRAINED, n):]).float()
        logits.log_softmax(-1)[:, 0].mean().backward()

    step(16)  # warm-up: the LoRA gradients' buffers, one-time allocations
    out = []
    for context in contexts:  # each pass's tensors are unmapped when freed (run_child's MALLOC_MMAP_THRESHOLD_)
        gc.collect()
        before = _rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the RSS now
        step(context)
        out.append({"model": model, "layers": layers, "dtype": dtype, "checkpointing": checkpointing,
                    "context": context, "growth": _rss("VmHWM") - before})
    return out


def head_one(model: str, dtype: str, context: int, trained: list[int]) -> list[dict]:
    """In this (child) process: the peak RSS growth of one pass at `context` tokens, the LM head at each number of
    trained positions in turn (the head's logits, their fp32 log-softmax and the backward through them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_sdk import models

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(models.resolve(f"shape:{model}@1"), dtype=getattr(torch, dtype),
                                                attn_implementation="sdpa")
    base.config.use_cache = False
    peft = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    peft.train()
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    ids = torch.randint(0, base.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    out = []
    for n in [16, *trained]:
        gc.collect()
        before = _rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        hidden = decoder(input_ids=ids, attention_mask=None, use_cache=False).last_hidden_state
        logits = head(hidden[0, -n:]).float() / 0.7  # as the trainer: fp32, over the temperature
        logits.log_softmax(-1)[:, 0].mean().backward()
        del hidden, logits
        out.append({"trained": n, "growth": _rss("VmHWM") - before})
    return out[1:]


def run_child(model: str, layers: int, dtype: str, checkpointing: bool, contexts: list[int]) -> list[dict]:
    # A fixed mmap threshold: every tensor of 64 KiB or more is mapped on its own and unmapped when freed, so one
    # context's pass leaves nothing resident that the next one's growth would hide.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    args = [model, layers, dtype, checkpointing, ",".join(map(str, contexts))]
    out = subprocess.run([sys.executable, __file__, "--one", *map(str, args)], env=env, capture_output=True,
                         text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fit_two(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares y = c1 x1 + c2 x2 (no intercept) over (x1, x2, y): (c1, c2)."""
    s11 = sum(a * a for a, _, _ in rows)
    s22 = sum(b * b for _, b, _ in rows)
    s12 = sum(a * b for a, b, _ in rows)
    s1y = sum(a * y for a, _, y in rows)
    s2y = sum(b * y for _, b, y in rows)
    det = s11 * s22 - s12 * s12
    return (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--head", action="store_true", help="only the LM head's bytes per trained token and vocabulary "
                   "entry (qwen2.5-0.5b@1, 1024 tokens, the head at 16..1024 of them), fp32 and bf16")
    p.add_argument("--head-one", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="one model (qwen2.5-0.5b), contexts 512 and 2048")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--save", type=Path, help="also write the measurements here (JSON lines, one per run)")
    p.add_argument("--load", type=Path, help="fit these measurements (a --save file) instead of measuring")
    a = p.parse_args()
    if a.head_one:
        print(json.dumps(head_one("qwen2.5-0.5b", a.head_one[0], 1024, [int(n) for n in a.head_one[1].split(",")])))
        return
    if a.head:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
        from lightning_sdk.models import shapes

        vocab = shapes.config("shape:qwen2.5-0.5b").vocab_size
        for dtype in a.dtypes:
            out = subprocess.run([sys.executable, __file__, "--head-one", dtype, "16,256,1024"], env=env,
                                 capture_output=True, text=True, timeout=900, check=True)
            pts = json.loads(out.stdout.strip().splitlines()[-1])
            _, b = linear_fit([p["trained"] for p in pts], [p["growth"] for p in pts])
            print(f"head {dtype}: " + ", ".join(f"{p['trained']} trained {p['growth'] / 2**20:.0f} MiB" for p in pts)
                  + f"; {b:.0f} B per trained token = {b / vocab:.2f} B per logit")
        return
    if a.one:
        model, layers, dtype, ckpt, context = a.one
        print(json.dumps(one(model, int(layers), dtype, ckpt == "True", [int(c) for c in context.split(",")])))
        return
    models_, contexts = (["qwen2.5-0.5b"], [512, 2048]) if a.quick else (a.models, a.contexts)
    results = [json.loads(line) for line in a.load.read_text().splitlines()] if a.load else []
    if a.load:
        models_ = list(dict.fromkeys(r["model"] for r in results))
        contexts = sorted({r["context"] for r in results})
        a.dtypes = list(dict.fromkeys(r["dtype"] for r in results))
    print(f"{'model':<14} {'dtype':<9} {'ckpt':<5} {'layers':>6} " + " ".join(f"{'L=' + str(c):>9}" for c in contexts)
          + "   (peak RSS growth, MiB)", flush=True)
    for model in models_:
        for dtype in a.dtypes:
            for ckpt in (False, True):
                for layers in (1, 2):
                    row = [r for r in results if (r["model"], r["layers"], r["dtype"], r["checkpointing"]) ==
                           (model, layers, dtype, ckpt)]
                    if not a.load:
                        row = run_child(model, layers, dtype, ckpt, contexts)
                        results += row
                        if a.save:
                            with a.save.open("a") as f:
                                f.writelines(json.dumps(r) + "\n" for r in row)
                    print(f"{model:<14} {dtype:<9} {str(ckpt):<5} {layers:>6} "
                          + " ".join(f"{r['growth'] / 2**20:>9.1f}" for r in row), flush=True)
    fit(results, models_, a.dtypes)


def fit(results: list[dict], models_: list[str], dtypes: list[str]) -> None:
    """The per-depth fits, the per-layer and outside-the-layers bytes, the constants over the models, and the
    estimate memory.py makes of each measured slope."""
    from lightning_sdk.memory import ACTIVATION, OUTSIDE, ModelShape, activation_bytes
    from lightning_sdk.models import shapes

    print("\nfit per depth: growth = a + b x L (b: bytes per token); per layer = b(2 layers) - b(1 layer); outside "
          "= b(1) - per layer (- the layer recomputed, with checkpointing), per unit of hidden_size")
    per_layer: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
    outside: dict[tuple[str, bool], list[float]] = {}
    slopes: dict[tuple[str, str, bool, int], float] = {}
    for model in models_:
        shape = ModelShape.of(shapes.config(f"shape:{model}"))
        for dtype in dtypes:
            for ckpt in (False, True):
                fits = {}
                done = {(r["model"], r["layers"], r["dtype"], r["checkpointing"]) for r in results}
                if not all((model, n, dtype, c) in done for n in (1, 2) for c in (False, ckpt)):
                    continue  # a partial --load
                for layers in (1, 2):
                    pts = [r for r in results if (r["model"], r["layers"], r["dtype"], r["checkpointing"]) ==
                           (model, layers, dtype, ckpt)]
                    fits[layers] = linear_fit([r["context"] for r in pts], [r["growth"] for r in pts])
                    slopes[(model, dtype, ckpt, layers)] = fits[layers][1]
                layer = fits[2][1] - fits[1][1]
                per_layer.setdefault((dtype, ckpt), []).append((shape.hidden, shape.intermediate, layer))
                rest = fits[1][1] - layer - (slopes[(model, dtype, False, 2)] - slopes[(model, dtype, False, 1)]
                                             if ckpt else 0)
                outside.setdefault((dtype, ckpt), []).append(rest / shape.hidden)
                print(f"  {model:<14} {dtype:<9} ckpt={str(ckpt):<5} a={fits[2][0] / 2**20:6.1f} MiB  "
                      f"b(1)={fits[1][1]:7.0f}  b(2)={fits[2][1]:7.0f}  per layer={layer:7.0f}  "
                      f"outside={rest / shape.hidden:5.1f} x hidden")
    if len({m for m, *_ in slopes}) >= 2:
        print("\nper layer = c_h x hidden + c_i x intermediate (least squares over the models; checkpointing: c_h "
              "only, the layer's input); outside = its mean over the models:")
        for (dtype, ckpt), rows in per_layer.items():
            if len(rows) < 2:
                continue
            ch, ci = (sum(y * h for h, _, y in rows) / sum(h * h for h, _, _ in rows), 0.0) if ckpt else \
                fit_two(rows)
            print(f"  ACTIVATION[({dtype!r}, {ckpt})] = ({ch:.1f}, {ci:.1f})   OUTSIDE[({dtype!r}, {ckpt})] = "
                  f"{sum(outside[(dtype, ckpt)]) / len(outside[(dtype, ckpt)]):.1f}   memory.py holds "
                  f"{ACTIVATION[(dtype, ckpt)]}, {OUTSIDE[(dtype, ckpt)]}")
    print("\nmemory.py's estimate of each measured slope (bytes per token of the whole pass):")
    worst = 0.0
    for (model, dtype, ckpt, layers), b in slopes.items():
        said = activation_bytes(ModelShape.of(shapes.config(f"shape:{model}@{layers}")), 1, dtype, ckpt)
        worst = max(worst, abs(said / b - 1))
        print(f"  {model:<14} {dtype:<9} ckpt={str(ckpt):<5} layers={layers}: measured {b:7.0f}, "
              f"estimated {said:7.0f} ({said / b - 1:+.1%})")
    print("activation_bytes: " + " ".join(
        f"{d}{'_ckpt' if c else ''}={sum(r[2] for r in rows) / len(rows):.0f}" for (d, c), rows in per_layer.items())
        + f" (mean per-layer bytes per token over the models) worst_estimate_error={worst:.1%}")

if __name__ == "__main__":
    main()
