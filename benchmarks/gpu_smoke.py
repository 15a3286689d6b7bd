"""GPU smoke run: `lightning run` with the vLLM backend for 2 iterations on one GPU, then its figures.

    bash benchmarks/gpu_smoke.sh        # finds or makes an environment with vllm, then runs this

Collection (vLLM, LoRA hot-loaded) and update (GRPO on a QLoRA or LoRA adapter) alternate on the same GPU; vLLM
sleeps (level 1) during each update. Prints per iteration: collection tokens/s, update step time, adapter hot-load
time, sleep and wake time, the trainer-vs-vLLM log-prob gap, and the peak GPU memory (whole device, from
nvidia-smi, and the trainer's own from torch); the reference in the same run is the update itself: the handover
overhead is printed as a ratio of the update step time.

Environment: LIGHTNING_GPU_MODEL a local Hugging Face model directory, e.g. Qwen2.5-0.5B-Instruct (default
builtin:tiny-arith, built here in ~20 s); SMOKE_QUANT 4bit|none (default 4bit, QLoRA); SMOKE_ITERS (2);
SMOKE_EAGER 1|0 (default 1: vLLM --enforce-eager, a much shorter start); SMOKE_GPU_UTIL (0.3).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_sdk import config  # noqa: E402
from lightning_sdk.runtime import Runtime  # noqa: E402
from lightning_sdk.servers.vllm import vllm_unavailable_reason  # noqa: E402
from lightning_sdk import metric_names as names  # noqa: E402


class GPUMemoryPeak:
    """Polls nvidia-smi for the device's used memory (all processes: vLLM's too), keeping the peak."""

    def __init__(self, every: float = 0.25):
        self.every, self.peak_mib, self._stop = every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                                  os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                self.peak_mib = max(self.peak_mib, int(out.stdout.split()[0]))
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def smoke_config(run_dir: Path) -> config.Config:
    model = os.environ.get("LIGHTNING_GPU_MODEL", "builtin:tiny-arith")
    tiny = model.startswith("builtin:")
    return config.parse({
        "run": {"name": "gpu-smoke", "dir": str(run_dir), "iterations": int(os.environ.get("SMOKE_ITERS", "2"))},
        "agent": {"module": str(ROOT / "benchmarks/gpu_smoke_agent.py")},
        "data": {"train": str(ROOT / "cookbook/arith/data/train.jsonl"), "tasks_per_iteration": 16,
                 "group_size": 8},
        "model": {"name": model, "dtype": "bfloat16", "quantization": os.environ.get("SMOKE_QUANT", "4bit")},
        "serve": {"backend": "vllm", "max_model_len": 512 if tiny else 2048, "startup_timeout": 420,
                  "gpu_memory_utilization": float(os.environ.get("SMOKE_GPU_UTIL", "0.3")),
                  "extra_args": ["--enforce-eager"] if os.environ.get("SMOKE_EAGER", "1") == "1" else []},
        "rollout": {"concurrency": 128, "timeout": 120},
        "train": {"lr": 1e-4, "lora_r": 16, "lora_alpha": 32, "target_modules": "all-linear",
                  "micro_batch_size": 32, "gradient_checkpointing": True, "importance_sampling_cap": 2.0},
    })


def main() -> int:
    why_not = vllm_unavailable_reason()
    if why_not:
        print(f"gpu_smoke: cannot run: {why_not} (see docs/gpu.md: pip install -e '.[gpu]')", file=sys.stderr)
        return 2
    import torch

    cfg = smoke_config(Path(tempfile.mkdtemp(prefix="lightning-gpu-smoke-")) / "run")
    print(f"gpu_smoke: {torch.cuda.get_device_name(0)}; model {cfg.model.name}, quantization "
          f"{cfg.model.quantization}, {cfg.run.iterations} iterations of {cfg.data.tasks_per_iteration} x "
          f"{cfg.data.group_size} rollouts; run dir {cfg.run.dir}", flush=True)
    t0 = time.perf_counter()
    with GPUMemoryPeak() as mem:
        state = Runtime(cfg).run()
    wall = time.perf_counter() - t0
    for row in state.history:
        tok_s = row[names.COMPLETION_TOKENS] / row[names.timing("collect_s")]
        handover = row.get("time/sleep_s", 0.0) + row.get("time/wake_s", 0.0)
        print(f"iteration {row['iteration']}: collect {row['rollout/completion_tokens']} tokens in "
              f"{row['time/collect_s']:.2f} s = {tok_s:.0f} tokens/s | update step {row['time/update_s']:.2f} s | "
              f"hot-load {row['time/hotload_s']:.3f} s | sleep {row.get('time/sleep_s', float('nan')):.2f} s, "
              f"wake {row.get('time/wake_s', float('nan')):.2f} s (sleep+wake / update step = "
              f"{handover / row['time/update_s']:.2f}) | logprob gap trainer-vLLM {row['train/logprob_gap']:.4f} | "
              f"importance weight {row.get(names.train('is_weight'), float('nan')):.3f} | "
              f"reward {row[names.REWARD_MEAN]:.3f}")
    print(f"peak GPU memory: device {mem.peak_mib} MiB (nvidia-smi, vLLM + trainer); trainer "
          f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB allocated (torch)")
    print(f"RESULT gpu_smoke: {len(state.history)} iterations in {wall:.0f} s wall (server start included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
