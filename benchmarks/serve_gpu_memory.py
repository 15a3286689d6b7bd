"""What one GPU holds in each phase of `lightning serve` with [learn] and vLLM, on paper (lightning_sdk/memory.py's
constants and each model's configuration; nothing loaded), before and after the GPU is shared in time.

    python benchmarks/serve_gpu_memory.py [--gb 24] [--context 4096]

Models: Llama-3.1-8B, Qwen3-4B, Qwen2.5-1.5B, bf16, LoRA r 16 on every linear layer (train.lora_r's default),
one call up to `--context` tokens. Phases:
- before (the code without production/gpu_turn.py and servers/lent.py): vLLM at serve.gpu_memory_utilization = 0.5
  never sleeps; the trainer is resident from the first update on; each gate decision starts a second vLLM at the
  same share. Serving = vLLM + trainer; update = vLLM + trainer + activations + LM head; gate = serving + a second
  vLLM.
- after: vLLM at `--util` (default 0.9); the update runs with vLLM asleep (memory.VLLM_ASLEEP kept) and the trainer
  leaves the GPU after it; the gate scores on the serving vLLM (two LoRA slots). Serving = gate = vLLM + this
  process's CUDA context; update = vLLM asleep + trainer + activations + LM head, with the most rows a pass (32 down
  to 1, gradient checkpointing on) that fit.
Prints one markdown table (GB = 1e9 bytes) and, last, `fits_before=` / `fits_after=` (how many of the three fit).
"""

from __future__ import annotations

import argparse
import math

from lightning_sdk.memory import (CUDA_CONTEXT, GB, VLLM_ASLEEP, VLLM_RUNTIME, ModelShape, Setup, activation_bytes,
                                  budget, head_bytes)

# From each model's config.json on its hub page; Qwen3-4B is not among models.shapes' families.
QWEN3_4B = dict(num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=40960, model_type="qwen3")


def shapes() -> list[tuple[str, ModelShape]]:
    from types import SimpleNamespace

    from lightning_sdk.models import shapes as family

    return [("Llama-3.1-8B", ModelShape.of(family.config("shape:llama-3.1-8b"))),
            ("Qwen3-4B", ModelShape.of(SimpleNamespace(**QWEN3_4B))),
            ("Qwen2.5-1.5B", ModelShape.of(family.config("shape:qwen2.5-1.5b")))]


def vllm_kv_calls(shape: ModelShape, util: float, device: float, context: int, loras: int = 2, r: int = 16) -> float:
    """Calls of `context` tokens vLLM's KV cache holds at `util` (what is left after the bf16 weights, the LoRA
    slots and its runtime); negative: the weights alone do not fit its share."""
    held = shape.parameters() * 2 + loras * shape.lora_parameters(r) * 2 + VLLM_RUNTIME
    return (util * device - held) / (shape.kv_bytes_per_token() * context)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=24.0)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--util", type=float, default=0.9, help="serve.gpu_memory_utilization after")
    a = ap.parse_args()
    device, n = a.gb * GB, a.context
    g = lambda x: f"{x / GB:.1f}"  # noqa: E731
    rows_out = ["| model | weights bf16 | LoRA + AdamW | KV / call | phase | before: on the GPU | after: on the GPU |",
                "|---|---:|---:|---:|---|---|---|"]
    fits_before = fits_after = 0
    for label, shape in shapes():
        w = shape.parameters() * 2
        lora = shape.lora_parameters(16) * 16
        kv_call = shape.kv_bytes_per_token() * n
        old = budget(shape, Setup(context=n, rows=1, checkpointing=True, gpu_memory_utilization=0.5, sleep_level=0),
                     device)
        vllm_old = 0.5 * device
        serving_old = old.collect
        update_old = old.update
        gate_old = old.collect + vllm_old
        kv_old = vllm_kv_calls(shape, 0.5, device, n)
        picked = None
        for r in (32, 16, 8, 4, 2, 1):
            b = budget(shape, Setup(context=n, rows=r, checkpointing=True, gpu_memory_utilization=a.util,
                                    sleep_level=1), device)
            if b.update <= device:
                picked = (r, b)
                break
        r, b = picked if picked else (1, budget(shape, Setup(context=n, rows=1, checkpointing=True,
                                                                gpu_memory_utilization=a.util), device))
        serving_new = a.util * device + CUDA_CONTEXT
        kv_new = vllm_kv_calls(shape, a.util, device, n)
        act = activation_bytes(shape, r * n, "bfloat16", True)
        head = head_bytes(shape, math.ceil(r * n * 0.25))
        before_ok = max(serving_old, update_old, gate_old) <= device and kv_old >= 1
        after_ok = max(serving_new, b.update) <= device and kv_new >= 1
        fits_before += before_ok
        fits_after += after_ok

        def kv(calls: float) -> str:
            return "the weights do not fit vLLM's share" if calls < 0 else f"KV {calls:.1f} calls"

        rows_out += [
            f"| {label} | {g(w)} | {g(lora)} | {g(kv_call)} | serving | vLLM {g(vllm_old)} ({kv(kv_old)}) + trainer "
            f"{g(old.collect - vllm_old)} = **{g(serving_old)}** | vLLM {g(a.util * device)} ({kv(kv_new)}) + "
            f"context {g(CUDA_CONTEXT)} = **{g(serving_new)}** |",
            f"| | | | | update | vLLM awake + trainer + activations + head (1 row) = **{g(update_old)}** | vLLM "
            f"asleep {g(VLLM_ASLEEP)} + trainer {g(b.update - VLLM_ASLEEP - act - head)} + activations {g(act)} + "
            f"head {g(head)} ({r} row{'s' * (r > 1)}, ckpt) = **{g(b.update)}** |",
            f"| | | | | gate | serving + a second vLLM {g(vllm_old)} = **{g(gate_old)}** | the serving vLLM "
            f"(candidate in a LoRA slot) = **{g(serving_new)}** |",
            f"| | | | | fits {a.gb:g} GB | {'yes' if before_ok else '**no**'} | {'yes' if after_ok else '**no**'} |",
        ]
    print("\n".join(rows_out))
    print(f"fits_before={fits_before}/3 fits_after={fits_after}/3")


if __name__ == "__main__":
    main()
