#!/usr/bin/env bash
# GPU proof (benchmarks/gpu_proof.py, docs/gpu.md): 3 iterations of the default agent on a random-initialised
# model of Qwen2.5-1.5B's shape, the built-in server and the trainer on one CUDA GPU (bf16, LoRA r 16 on every
# linear layer, gradient checkpointing on, then off), in under 8 minutes; no network. Where vllm imports (the [gpu]
# extra), then the same with serve.backend = "vllm": LoRA, and QLoRA where bitsandbytes imports (gpu_proof.py).
#
#   bash benchmarks/gpu_proof.sh               # on the GPU machine
#   bash benchmarks/gpu_proof.sh --cpu-smoke   # the same steps on the CPU, tiny config (tests/test_gpu_proof.py),
#                                              # with a 2-process (gloo) data-parallel update against one
#   bash benchmarks/gpu_proof.sh --gpus N      # and a data-parallel update on N GPUs against 1: speed-up, MFU/GPU
#
# This package is used from the checkout (PYTHONPATH), never installed with its dependencies. A machine that lacks
# some of them (it has torch, transformers, peft, accelerate) takes wheels from $WHEELS, a folder made on a machine
# with a package index: pip download -d wheels --only-binary=:all: --python-version X.Y <the names it prints>.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { echo "gpu_proof: no $PYTHON here (set PYTHON)" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# module -> the distribution that provides it
needed="torch:torch transformers:transformers peft:peft accelerate:accelerate tokenizers:tokenizers
safetensors:safetensors fastapi:fastapi uvicorn:uvicorn httpx:httpx openai:openai pydantic:pydantic click:click
rich:rich wrapt:wrapt opentelemetry.sdk:opentelemetry-sdk
opentelemetry.exporter.otlp.proto.http:opentelemetry-exporter-otlp-proto-http opentelemetry.proto:opentelemetry-proto
google.rpc:googleapis-common-protos matplotlib:matplotlib numpy:numpy"
missing() {  # one interpreter for all of them: torch alone takes seconds to import
  "$PYTHON" - $needed <<'PY' 2>/dev/null
import importlib, sys
for pair in sys.argv[1:]:
    module, dist = pair.split(":", 1)
    try:
        importlib.import_module(module)
    except Exception:
        print(dist, end=" ")
PY
}
lacking="$(missing)"
if [[ -n "$lacking" && -n "${WHEELS:-}" ]]; then
  echo "gpu_proof: installing from $WHEELS: $lacking" >&2
  # shellcheck disable=SC2086  # one argument per distribution
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" $lacking
  lacking="$(missing)"
fi
if [[ -n "$lacking" ]]; then
  echo "gpu_proof: missing: $lacking(set WHEELS to a folder of their wheels)" >&2
  exit 2
fi
if [[ " $* " != *" --cpu-smoke "* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
fi
"$PYTHON" -c "import vllm" 2>/dev/null && default_timeout=1200 || default_timeout=480  # vLLM's runs: 2 more starts
exec timeout "${PROOF_TIMEOUT:-$default_timeout}" "$PYTHON" benchmarks/gpu_proof.py "$@"
