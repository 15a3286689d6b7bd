#!/usr/bin/env bash
# GPU smoke run (one CUDA GPU): 2 iterations of `lightning run` on vLLM + QLoRA, printing collection tokens/s,
# update step time, adapter hot-load time, sleep/wake time and peak GPU memory (benchmarks/gpu_smoke.py).
#
#   bash benchmarks/gpu_smoke.sh                       # the builtin tiny model, QLoRA
#   LIGHTNING_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct SMOKE_QUANT=none bash benchmarks/gpu_smoke.sh
#
# Python: $PYTHON if set; else python3 when it already imports vllm and this project's dependencies; else the
# virtual environment .venv-gpu, made here with `pip install -e ".[gpu]"` (vllm pins its own CUDA torch, so
# never the CPU test .venv). Needs a reachable package index for that first install.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_smoke: no NVIDIA GPU here (nvidia-smi finds none)" >&2
  exit 2
fi
can_run() { "$1" -c "import vllm, peft, openai, lightning_sdk.runtime" >/dev/null 2>&1; }
if [[ -z "${PYTHON:-}" ]]; then
  if can_run python3; then
    PYTHON=python3
  else
    if [[ ! -x .venv-gpu/bin/python ]]; then
      python3 -m venv .venv-gpu
    fi
    if ! can_run .venv-gpu/bin/python; then
      echo "gpu_smoke: installing .[gpu] into .venv-gpu (vllm, CUDA torch: a few GB, once)" >&2
      .venv-gpu/bin/pip install -q -e ".[gpu]"
    fi
    PYTHON=.venv-gpu/bin/python
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c "import torch, vllm; print(f'torch {torch.__version__}, vllm {vllm.__version__}')"
exec timeout "${SMOKE_TIMEOUT:-480}" "$PYTHON" benchmarks/gpu_smoke.py
