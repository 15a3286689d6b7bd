"""GPU proof: the default agent (lightning.toml, cookbook/arith) for 3 iterations on a random-initialised model of
Qwen2.5-1.5B's shape, the built-in server and the trainer both on one CUDA GPU, with gradient checkpointing on and
then off. Learning is not the point: memory and speed are.

    bash benchmarks/gpu_proof.sh               # one GPU (docs/gpu.md); no network needed
    bash benchmarks/gpu_proof.sh --cpu-smoke   # the same steps on the CPU with a tiny config (a test runs it)
    bash benchmarks/gpu_proof.sh --gpus 4      # and a data-parallel update on 4 GPUs against 1 (train.processes)

Where vllm imports (the [gpu] extra), the same agent then runs with serve.backend = "vllm" (sleep mode on), with
LoRA and, where bitsandbytes imports, QLoRA (the trainer's nf4 base against vLLM's bf16 one): per iteration the
trainer-vs-vLLM logprob_gap, the importance weight, sleep and wake seconds.

Per iteration it prints collection tokens/s, update seconds, the update's model FLOPs utilisation (6 x the
parameters every token passes through x the tokens the update read / its seconds, against the card's bf16 peak),
the peak GPU memory of the server (its log line at each hot-load) and of the trainer (torch), and hot-load
seconds; then one line with the peak memory against a 24 GB card.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_sdk import config, models  # noqa: E402
from lightning_sdk import metric_names as names  # noqa: E402

HERE = Path(__file__).with_suffix("")  # benchmarks/gpu_proof/: the model configs
PEAK_BF16_FLOPS = 790e12  # measured on the H200 this is meant for: the physical limit the update is judged by
CARD_BYTES = 24 * 2**30  # a 24 GB card (RTX 4090, L4, A10G)
# the server's line at each hot-load: GPU memory allocated on a GPU, resident size on the CPU
SERVER_PEAK = re.compile(r"loaded lora adapter (\S+) from .* \(peak (?:GPU memory allocated|RSS) (\d+) MiB\)")


def build_model(spec_file: Path, out: Path, device: str) -> int:
    """A random-initialised model of the shape in `spec_file`, with the built-in tokenizer (no download), saved
    to `out` in bf16 (float32 on the CPU); returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = models.load_tokenizer(models.resolve("builtin:tiny-arith"))
    spec = json.loads(spec_file.read_text())
    spec.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):  # initialised where it will run: seconds on a GPU instead of a minute on the CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def run_config(model_dir: Path, run_dir: Path, device: str, checkpointing: bool, smoke: bool) -> config.Config:
    """lightning.toml (the default agent and data) with the model, devices and LoRA of the proof."""
    cfg = config.load(ROOT / "lightning.toml")
    return config.override(cfg, {
        "run.name": f"proof-ckpt-{'on' if checkpointing else 'off'}", "run.dir": str(run_dir), "run.iterations": 3,
        "run.report_to": [], "data.eval": None,
        **({"data.tasks_per_iteration": 4, "data.group_size": 4} if smoke else {}),
        "model.name": str(model_dir), "model.dtype": "float32" if smoke else "bfloat16",
        "serve.device": device, "serve.max_model_len": 512 if smoke else 2048, "serve.startup_timeout": 300,
        "train.device": device, "train.lora_r": 16, "train.lora_alpha": 32, "train.target_modules": "all-linear",
        "train.gradient_checkpointing": checkpointing,
    })


def server_peaks(log: Path) -> dict[str, int]:
    """Adapter name -> the server's peak GPU memory (MiB) when it hot-loaded it: through that iteration's
    collection."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {m.group(1): int(m.group(2)) for m in SERVER_PEAK.finditer(text)}


def proof_run(model_dir: Path, params: int, device: str, checkpointing: bool, smoke: bool, work: Path,
              lines: list[str]) -> int | None:
    """One run of 3 iterations; appends a line per iteration to `lines` and returns the peak of server + trainer
    GPU memory (MiB; None on the CPU)."""
    import gc

    import torch

    from lightning_sdk.runtime import Runtime

    gc.collect()  # the previous run's trainer, if any, is gone before this one is measured
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    mode = f"[ckpt {'on ' if checkpointing else 'off'}]"
    run_dir = work / f"run-ckpt-{'on' if checkpointing else 'off'}"
    cfg = run_config(model_dir, run_dir, device, checkpointing, smoke)
    t0 = time.perf_counter()
    state = Runtime(cfg).run()
    wall = time.perf_counter() - t0
    served = server_peaks(run_dir / "server.log")
    worst = None
    for row in state.history:
        tokens = row["train/num_input_tokens"] * cfg.train.epochs
        flops = 6 * params * tokens / row[names.timing("update_s")]
        mfu = f"MFU {flops / PEAK_BF16_FLOPS:.2%} of {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s" if device == "cuda" \
            else f"{flops / 1e9:.2f} GFLOP/s (CPU: no MFU)"
        server = served.get(f"{cfg.run.name}-iter{row['iteration']}")
        trainer = row.get("train/max_memory_allocated")
        trainer = None if trainer is None else trainer / 2**20
        if device == "cuda" and server is not None and trainer is not None:
            worst = max(worst or 0, int(server + trainer))
        memory = (f"peak GPU memory server {_mib(server)}, trainer {_mib(trainer)}" if device == "cuda" else
                  f"peak memory server {_mib(server)} (RSS), trainer n/a (CPU)")
        tokens_made, collect_s = row["rollout/completion_tokens"], row["time/collect_s"]
        lines.append(f"{mode} iteration {row['iteration']}: collect {tokens_made / collect_s:.0f} "
                     f"tokens/s ({tokens_made} tokens in {collect_s:.2f} s) | update "
                     f"{row['time/update_s']:.2f} s, {tokens:.0f} tokens, {mfu} | {memory} | hot-load "
                     f"{row['time/hotload_s']:.2f} s")
        print(lines[-1], flush=True)
    lines.append(f"{mode} 3 iterations in {wall:.0f} s (server and trainer start included)")
    print(lines[-1], flush=True)
    return worst


def vllm_runs(model_dir: Path, work: Path, lines: list[str]) -> None:
    """serve.backend = "vllm" on the GPU: LoRA, then QLoRA where bitsandbytes imports; 3 iterations each."""
    import importlib.util

    from lightning_sdk.runtime import Runtime

    for quantization in ("none", "4bit") if importlib.util.find_spec("bitsandbytes") else ("none",):
        cfg = config.override(run_config(model_dir, work / f"run-vllm-{quantization}", "cuda", True, False), {
            "run.name": f"proof-vllm-{quantization}", "serve.backend": "vllm", "serve.sleep_level": 1,
            "serve.gpu_memory_utilization": 0.3, "serve.startup_timeout": 900, "model.quantization": quantization})
        t0 = time.perf_counter()
        state = Runtime(cfg).run()
        for row in state.history:
            nan = float("nan")
            lines.append(f"[vllm {quantization}] iteration {row['iteration']}: collect "
                         f"{row['rollout/completion_tokens'] / row['time/collect_s']:.0f} tokens/s | update "
                         f"{row['time/update_s']:.2f} s | logprob_gap {row.get('train/logprob_gap', nan):.4f}, is_weight "
                         f"{row.get('train/is_weight', nan):.3f} | sleep {row.get('time/sleep_s', nan):.2f} s, wake "
                         f"{row.get('time/wake_s', nan):.2f} s | hot-load {row['time/hotload_s']:.2f} s")
            print(lines[-1], flush=True)
        lines.append(f"[vllm {quantization}] 3 iterations in {time.perf_counter() - t0:.0f} s (vLLM start included)")
        print(lines[-1], flush=True)


def data_parallel(model_dir: Path, params: int, device: str, n: int, lines: list[str]) -> None:
    """One update on one device against train.processes = n (benchmarks/data_parallel.py), the same batches."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from data_parallel import compare

    smoke = device == "cpu"
    r = compare(str(model_dir), n, device, updates=2 if smoke else 3, prompts=4 if smoke else 16, group=4 if smoke
                else 8, length=32 if smoke else 512, micro_batch_size=8 if smoke else 16, threads=2 if smoke else None)

    def speed(seconds: float, devices: int) -> str:
        flops = 6 * params * r["tokens"] / seconds / devices
        return (f"MFU {flops / PEAK_BF16_FLOPS:.2%} per GPU" if device == "cuda" else
                f"{flops / 1e9:.2f} GFLOP/s per process (CPU: no MFU)")
    lines.append(f"[data-parallel] update of {r['tokens']:.0f} tokens: 1 {'GPU' if device == 'cuda' else 'process'} "
                 f"{r['one_s']:.2f} s, {speed(r['one_s'], 1)} | {n} {'GPUs' if device == 'cuda' else 'processes'} "
                 f"{r['n_s']:.2f} s, {speed(r['n_s'], n)} | speed-up {r['one_s'] / r['n_s']:.2f}x")
    print(lines[-1], flush=True)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} MiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="the same steps on the CPU with a tiny config")
    p.add_argument("--gpus", type=int, default=1, help="with N > 1, also a data-parallel update on N GPUs "
                   "(train.processes = N) against one, on the same batches: speed-up and MFU per GPU")
    args = p.parse_args()
    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_proof: no CUDA GPU is visible to torch; use --cpu-smoke to check the steps on the CPU",
              file=sys.stderr)
        return 2
    if args.gpus < 1 or (device == "cuda" and args.gpus > torch.cuda.device_count()):
        print(f"gpu_proof: --gpus {args.gpus}: expected 1 to the {torch.cuda.device_count() if device == 'cuda' else 1}"
              f" GPU(s) torch sees", file=sys.stderr)
        return 2
    spec = HERE / ("config-cpu-smoke.json" if args.cpu_smoke else "config.json")
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="lightning-gpu-proof-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        params = build_model(spec, work / "model", device)
        where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
        lines.append(f"gpu_proof: {where}, torch {torch.__version__}; random-init model of {spec.name} "
                     f"({params / 1e6:.1f}M parameters) built in {time.perf_counter() - t0:.1f} s")
        print(lines[-1], flush=True)
        peaks = {ckpt: proof_run(work / "model", params, device, ckpt, args.cpu_smoke, work, lines)
                 for ckpt in (True, False)}
        # the data-parallel update: 2 gloo processes on the CPU smoke run (CI covers the path), N GPUs here
        if args.cpu_smoke or args.gpus > 1:
            data_parallel(work / "model", params, device, 2 if args.cpu_smoke else args.gpus, lines)
        import importlib.util

        if device == "cuda" and importlib.util.find_spec("vllm") is not None:
            vllm_runs(work / "model", work, lines)
        elif device == "cuda":
            lines.append("vLLM: not importable here, its runs skipped (the [gpu] extra installs it)")
    card = CARD_BYTES / 2**20
    lines.append("peak GPU memory vs a 24 GB card: " + ("n/a (CPU smoke run)" if device == "cpu" else "; ".join(
        f"checkpointing {'on' if ckpt else 'off'}: server + trainer " + (
            "n/a" if mib is None else f"{mib / 1024:.1f} GiB of {card / 1024:.0f} GiB ({mib / card:.0%}, "
                                      f"{'fits' if mib <= card else 'does not fit'})")
        for ckpt, mib in peaks.items())))
    print("\n--- gpu_proof summary ---\n" + "\n".join(lines), flush=True)  # together at the end of a long log
    return 0


if __name__ == "__main__":
    sys.exit(main())
