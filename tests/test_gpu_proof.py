"""benchmarks/gpu_proof.sh --cpu-smoke: the GPU proof's every step (a random-init Qwen2-shaped model from the
shipped config with the built-in tokenizer, 3 iterations of the default agent with gradient checkpointing on and
off, the per-iteration figures, the server's peak-memory line at each hot-load) on the CPU, so the script cannot
rot before a GPU runs it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"\[ckpt (on |off)\] iteration (\d): collect (\d+) tokens/s \((\d+) tokens in [\d.]+ s\) \| update "
                  r"[\d.]+ s, (\d+) tokens, [\d.]+ GFLOP/s \(CPU: no MFU\) \| peak memory server (\d+) MiB \(RSS\), "
                  r"trainer n/a \(CPU\) \| hot-load [\d.]+ s")


def test_the_gpu_proof_runs_its_steps_on_the_cpu():
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_proof.sh"), "--cpu-smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = out.stdout.split("--- gpu_proof summary ---\n", 1)[1].splitlines()
    assert re.fullmatch(r"gpu_proof: CPU, torch \S+; random-init model of config-cpu-smoke.json \([\d.]+M "
                        r"parameters\) built in [\d.]+ s", summary[0]), summary[0]
    rows = [LINE.fullmatch(line) for line in summary if "] iteration " in line]
    assert all(rows) and [(m.group(1), int(m.group(2))) for m in rows] == [
        ("on ", 1), ("on ", 2), ("on ", 3), ("off", 1), ("off", 2), ("off", 3)], summary
    assert all(int(m.group(3)) > 0 and int(m.group(5)) > int(m.group(4)) and int(m.group(6)) > 0 for m in rows)
    dp = [line for line in summary if line.startswith("[data-parallel]")]
    assert len(dp) == 1 and re.fullmatch(  # the 2-process (gloo) update ran against one process
        r"\[data-parallel\] update of \d+ tokens: 1 process [\d.]+ s, [\d.]+ GFLOP/s per process \(CPU: no MFU\) \| "
        r"2 processes [\d.]+ s, [\d.]+ GFLOP/s per process \(CPU: no MFU\) \| speed-up [\d.]+x", dp[0]), dp
    assert summary[-1] == "peak GPU memory vs a 24 GB card: n/a (CPU smoke run)"
