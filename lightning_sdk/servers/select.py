"""Which inference server a run gets: `serve.backend` ("cpu", "vllm" or "auto") made into an unstarted server.

The single-process choice only; the Ray runtime builds its own servers. Backends are imported inside the
functions, so that choosing one never imports the other's modules.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sdk.errors import SetupError
from lightning_sdk.placement import Placement, gpu_environment, place
from lightning_sdk.servers.process import new_api_key

if TYPE_CHECKING:
    from lightning_sdk.config import Config

log = logging.getLogger("lightning_sdk")  # the runtime's logger: these lines are part of a run's log
BACKEND_HOST = "127.0.0.1"  # agents call the gateway (serve.host); the backend behind it stays on this machine


def make_server(cfg: Config, model_path: str, log_path: Path, placement: Placement | None = None):
    """The run's inference backend on 127.0.0.1 (free ports), behind a key of its own made for this run: agents
    reach it only through the gateway (gateway/proxy.py), which holds the key. One server per replica of the
    placement (placement.py; `placement`, default this machine's), each given its GPUs through CUDA_VISIBLE_DEVICES;
    several make a ReplicaSet."""
    replicas = (placement or placement_of(cfg)).replicas
    api_key = new_api_key()
    servers = []
    for i, gpus in enumerate(replicas):
        log = log_path if i == 0 else log_path.with_name(f"{log_path.stem}-{i}{log_path.suffix}")
        server = one_server(cfg, model_path, log, api_key, gpus=gpus, index=i, share=len(replicas))
        server.gpu_env = gpu_environment(gpus)
        servers.append(server)
    if len(servers) == 1:
        return servers[0]
    from lightning_sdk.servers.replicas import ReplicaSet

    return ReplicaSet(servers)


def one_server(cfg: Config, model_path: str, log_path: Path, api_key: str, *, gpus: tuple[int, ...] = (),
               index: int = 0, share: int = 1):
    """Replica `index`, unstarted: vLLM, or the built-in server, which holds the base as the trainer does (nf4 for
    model.quantization = "4bit"), so it samples from the policy being trained. `gpus`: the GPUs its process sees
    (so the built-in server takes 'cuda'); `share`: the replicas the server's CPU threads are divided among. Each
    replica's sampler draws a stream of its own, so a group's rollouts on two replicas never share samples."""
    from lightning_sdk.servers.cpu import CPUServer

    backend = cfg.serve.backend
    if backend != "cpu":
        from lightning_sdk.servers.vllm import vllm_unavailable_reason

        if backend == "auto":
            why_not = vllm_unavailable_reason()
            backend = "cpu" if why_not else "vllm"
            log.info("serve.backend = 'auto': using %s", f"the built-in CPU server ({why_not})" if why_not
                     else "vLLM (CUDA GPU and vllm found)")
        else:
            check_vllm(cfg)
    if backend == "vllm":
        seed = ["--seed", str(index)] if index and "--seed" not in cfg.serve.extra_args else []
        return vllm_server(cfg, model_path, log_path, api_key=api_key, more_args=seed)
    return CPUServer(
        model_path, served_model_name=cfg.model.name, host=BACKEND_HOST, port=0,
        api_key=api_key, max_batch_size=cfg.serve.max_batch_size, max_model_len=cfg.serve.max_model_len,
        dtype=cfg.model.dtype, quantization=cfg.model.quantization, startup_timeout=cfg.serve.startup_timeout,
        log_path=log_path, seed=(server_seed(cfg) + index) % 2**32, device="cuda" if gpus else cfg.serve.device,
        threads=max(1, split[0] // share) if (split := cpu_threads(cfg)) else None,
        tool_call_parser=cfg.serve.tool_call_parser, reasoning_parser=cfg.serve.reasoning_parser,
    )


def visible_gpus(cfg: Config, *, counted: bool = False) -> int:
    """The CUDA GPUs this process sees (torch's count). Unless `counted`, 0 without asking torch (whose import takes
    seconds, before the run's first line) where the servers are the built-in one on the CPU and [devices] is not
    set: nothing is then placed, and the trainer goes where train.device says, as on one GPU."""
    if not counted and cfg.serve.backend == "cpu" and cfg.serve.device == "cpu" and cfg.devices.serve is None \
            and cfg.devices.train is None:
        return 0
    try:
        import torch
    except ImportError:  # a serving-only environment: vLLM's own torch is in its process, not this one
        return 0
    return torch.cuda.device_count()


def placement_of(cfg: Config) -> Placement:
    """placement.place for this machine: its visible GPUs and serve.backend resolved."""
    return place(cfg, visible=visible_gpus(cfg), backend=resolved_backend(cfg))


def cpu_threads(cfg: Config) -> tuple[int, int | None] | None:
    """(server, trainer) torch threads when the built-in server and the trainer share this machine's CPU; None
    when they do not, or when OMP_NUM_THREADS says how many (torch follows it in both processes).

    Two pools on the same cores slow each other down several times over (each op waits at a barrier for threads
    the other pool keeps off a core), so they never get the same cores at the same time. Alternating
    (train.max_staleness = 0): the trainer runs alone and keeps torch's default (every core); the server leaves
    one core to the agents and the gateway, which run beside it. Pipelined: serving and training run at once, and
    the cores are split between them."""
    if cfg.serve.device != "cpu" or resolved_backend(cfg) != "cpu" or cfg.train.device not in ("cpu", "auto") \
            or cfg.run.runtime == "ray" or os.environ.get("OMP_NUM_THREADS"):
        return None
    if cfg.train.device == "auto":
        import torch

        if torch.cuda.is_available() or torch.backends.mps.is_available():
            return None
    cores = usable_cores()
    if not cfg.train.max_staleness:
        return max(1, cores - 1), None
    return max(1, cores - cores // 2), max(1, cores // 2)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS says; else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolved_backend(cfg: Config) -> str:
    """'cpu' or 'vllm': the backend make_server (or the Ray runtime, for each replica) starts for `cfg`
    (serve.backend 'auto' decided the same way)."""
    if cfg.serve.backend == "cpu":
        return "cpu"
    if cfg.serve.backend == "vllm":
        return "vllm"
    from lightning_sdk.servers.vllm import vllm_unavailable_reason

    return "cpu" if vllm_unavailable_reason() else "vllm"


def server_seed(cfg: Config) -> int:
    """The sampler's seed: run.seed and the iterations run.dir's checkpoints already hold, so another run.seed and
    every resume draw a stream of their own instead of replaying the first start's."""
    import hashlib

    from lightning_sdk.train.checkpoint import RunState, latest_checkpoint

    done = latest_checkpoint(cfg.run.dir)
    completed = RunState.read(done).completed if done is not None else 0
    return int.from_bytes(hashlib.sha256(f"{cfg.run.seed}:{completed}".encode()).digest()[:4], "big")


def vllm_server(cfg: Config, model_path: str, log_path: Path, **kw: Any):
    """vLLM on 127.0.0.1 (a free port) with room for every policy's rank, and for two adapters per policy: a new one
    is loaded before the old one goes (three when pipelined: the one replaced stays for the requests already routed
    to it, until the next update). The tool-call and reasoning parsers are the model's own (parsers_for).

    QLoRA (model.quantization = "4bit"): vLLM serves the bf16 base while the trainer holds it in nf4. vLLM 0.32 (the
    [gpu] pin) has no bitsandbytes quantization (`--quantization` offers no nf4 method), so the sampler cannot hold
    the trainer's base; the gap is measured every iteration (train.logprob_gap) and corrected by the truncated
    importance weight (docs/gpu.md)."""
    from lightning_sdk.config import policies
    from lightning_sdk.servers.vllm import VLLMServer

    s, ps = cfg.serve, policies(cfg)
    loras = (3 if cfg.train.max_staleness else 2) * len(ps)
    kw.setdefault("api_key", new_api_key())
    more_args = kw.pop("more_args", [])
    tool_call_parser, reasoning_parser = parsers_for(cfg, model_path)
    return VLLMServer(model_path, served_model_name=cfg.model.name, lora_r=max(p.train.lora_r for p in ps),
                      host=BACKEND_HOST, port=0, max_loras=max(s.max_loras, loras), dtype=cfg.model.dtype,
                      max_model_len=s.max_model_len, gpu_memory_utilization=s.gpu_memory_utilization,
                      sleep_level=s.sleep_level, tool_call_parser=tool_call_parser,
                      reasoning_parser=reasoning_parser, extra_args=[*s.extra_args, *more_args],
                      tensor_parallel_size=s.tensor_parallel_size,
                      startup_timeout=s.startup_timeout, log_path=log_path, **kw)


def check_vllm(cfg: Config) -> None:
    """SetupError, naming the key, when serve.backend = "vllm" cannot run here (before anything starts)."""
    from lightning_sdk.servers.vllm import on_cpu_build, vllm_unavailable_reason

    why_not = vllm_unavailable_reason(cpu_build=True)
    if why_not:
        raise SetupError(f"serve.backend = 'vllm': {why_not}. Install the GPU extra with "
                         f"`pip install 'lightning-agent-rl[gpu]'` (its own environment, docs/gpu.md) on a CUDA "
                         f"machine, or set serve.backend = 'cpu'")
    if cfg.serve.sleep_level and on_cpu_build():
        raise SetupError("serve.sleep_level = 1: vLLM's CPU build (VLLM_TARGET_DEVICE=cpu) has no sleep mode; "
                         "set serve.sleep_level = 0")


def parsers_for(cfg: Config, model_path: str) -> tuple[str | None, str | None]:
    """(tool-call parser, reasoning parser) for vLLM: serve.tool_call_parser / serve.reasoning_parser, 'auto' read
    from the model. One line when no tool-call parser fits: vLLM will then refuse every request that offers tools."""
    from lightning_sdk.models import tool_parsers as vp

    applied = vp.server_grammar(model_path, cfg.serve.tool_call_parser, cfg.serve.reasoning_parser, compact=False)
    tools, reasoning = applied.tool_parser, applied.reasoning_parser
    if tools is None and cfg.serve.tool_call_parser == "auto":
        model_type = vp.read_json(model_path, "config.json").get("model_type")
        log.warning("serve.tool_call_parser = 'auto': no vLLM tool-call parser fits %s (model_type %r; its chat "
                    "template shows none of the tool-call formats known here), so vLLM will answer 400 to requests "
                    "with `tools`; set serve.tool_call_parser to the parser of the model's format", model_path,
                    model_type or "unknown")
    log.info("vLLM tool-call parser: %s; reasoning parser: %s", tools or "none", reasoning or "none")
    return tools, reasoning
