"""What would otherwise fail after the run directory is written, checked before it is: where the run goes, the
backend, the devices. Each fault is a SetupError naming the key (the port is checked when the gateway binds it).
Memory is a warning, not a fault (an estimate, memory.py): `say_memory` prints one line when the run's model and
context would not fit its trainer's device, for `lightning run` and `lightning check` alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rich.markup import escape

from lightning_sdk.config import Config
from lightning_sdk.errors import SetupError
from lightning_sdk.placement import Placement, place
from lightning_sdk.servers.select import placement_of, resolved_backend

MIN_FREE_BYTES = 64 * 2**20  # below this a run cannot even write its first checkpoint of a tiny model


def preflight(cfg: Config, run_dir: Path, placement: Placement | None = None) -> None:
    """`placement`: the run's (default: this machine's, placement_of)."""
    d = run_dir
    if d.exists() and not d.is_dir():
        raise SetupError(f"run.dir = {str(d)!r}: is a file; expected a directory (or a path that does not exist "
                         f"yet)")
    base = next(p for p in (d, *d.parents) if p.exists())
    if not base.is_dir():
        raise SetupError(f"run.dir = {str(d)!r}: {base} is a file, so no directory can be made under it")
    fs = os.statvfs(base)
    if fs.f_blocks == 0:  # procfs, sysfs: virtual file systems hold no files of ours
        raise SetupError(f"run.dir = {str(d)!r}: {base} is on a virtual file system (like /proc); choose a "
                         f"directory on a disk")
    if fs.f_flag & os.ST_RDONLY or not os.access(base, os.W_OK | os.X_OK):
        raise SetupError(f"run.dir = {str(d)!r}: {base} is read-only for this user; choose a writable directory")
    free = fs.f_bavail * fs.f_frsize
    if free < MIN_FREE_BYTES:
        raise SetupError(f"run.dir = {str(d)!r}: only {free / 2**20:.1f} MiB free on its disk; a run needs at "
                         f"least {MIN_FREE_BYTES / 2**20:.0f} MiB for its store and checkpoints")
    check_placement(cfg, placement_of(cfg) if placement is None else placement, resolved_backend(cfg))
    if cfg.serve.backend == "vllm":
        from lightning_sdk.servers.select import check_vllm

        check_vllm(cfg)  # refuses vllm where it cannot run
    for key, device in (("serve.device", cfg.serve.device), ("train.device", cfg.train.device)):
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise SetupError(f"{key} = {device!r}: no CUDA GPU is visible to torch; use 'cpu'"
                                 + (" or 'auto'" if key == "train.device" else ""))
            index = int(device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise SetupError(f"{key} = {device!r}: torch sees {torch.cuda.device_count()} GPU(s)")
    if cfg.train.device == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise SetupError("train.device = 'mps': MPS is not available here; use 'cpu' or 'auto'")


def check_placement(cfg: Config, placement: Placement, backend: str) -> None:
    """The faults of `cfg` placed so (placement.py, its defaults set) with servers of `backend`: a SetupError that
    names the keys (each said to be set or the default) and why they cannot go together there."""
    k, level = cfg.train.max_staleness, cfg.serve.sleep_level
    if not (k and level and backend == "vllm"):
        return
    staleness = f"train.max_staleness = {k}{_whose(cfg.train, 'max_staleness')}"
    sleep = f"serve.sleep_level = {level}{_whose(cfg.serve, 'sleep_level')}"
    if placement.apart:
        raise SetupError(f"{staleness} has vLLM serve the next batch during each update, so it never sleeps, but "
                         f"{sleep} asks it to sleep during each update; on GPUs of its own it need not: set "
                         f"serve.sleep_level = 0, or train.max_staleness = 0 (collection and update in turns)")
    where = f"on {'the GPUs' if len(placement.train) > 1 else 'the GPU'} they share" if placement.shared else ""
    raise SetupError(f"{staleness} has vLLM serve the next batch during each update, so vLLM and the trainer must "
                     f"fit in memory at once{' ' + where if where else ''}, but {sleep} puts vLLM to sleep for each "
                     f"update: set serve.sleep_level = 0 (and serve.gpu_memory_utilization to leave the trainer "
                     f"room), or train.max_staleness = 0")


def _whose(table: Any, key: str) -> str:
    return " (set)" if key in table.model_fields_set else " (the default)"


def memory_warning(cfg: Config, model_path: str | None = None, *, device: tuple[str, float, bool] | None = None,
                   visible: int | None = None) -> str | None:
    """One line when the run's model and context would not fit the device its trainer is given (memory.budget at
    the longest call serve.max_model_len allows, train.micro_batch_size rows of it), naming the settings that make
    it fit; None when it fits or cannot be told (a model whose configuration is not at hand, MPS/XPU, a base
    sharded with train.shard = 'fsdp'). `device` ((what, bytes, is_gpu)) and `visible` (the GPUs to place on)
    replace what this machine says."""
    from lightning_sdk.config import policies
    from lightning_sdk.memory import ModelShape, Setup, budget, fix, gb

    config = _model_config(cfg.model.name, model_path) if cfg.train.shard == "none" else None
    if config is None:
        return None
    shape = ModelShape.of(config)
    backend = resolved_backend(cfg)
    placement = placement_of(cfg) if visible is None else place(cfg, visible=visible, backend=backend)
    device = device or _trainer_device(cfg, placement.train)
    if device is None:
        return None
    what, size, gpu = device
    if cfg.run.runtime == "ray" or (backend == "vllm" and not placement.shared):
        server = "none"  # Ray places the servers; apart, vLLM has GPUs of its own
    elif backend == "vllm":
        server = "vllm"
    else:  # the built-in server shares the trainer's device when both are on the CPU or both on a GPU
        server = "builtin" if (cfg.serve.device != "cpu") == gpu else "none"
    context = cfg.serve.max_model_len or shape.context or 4096
    s = Setup(context=context, rows=cfg.train.micro_batch_size,
              dtype=shape.dtype if cfg.model.dtype == "auto" else cfg.model.dtype,
              quantization=cfg.model.quantization, lora_r=max(p.train.lora_r for p in policies(cfg)),
              targets=tuple(cfg.train.target_modules) if isinstance(cfg.train.target_modules, list)
              else cfg.train.target_modules, adapters=len(policies(cfg)),
              checkpointing=cfg.train.gradient_checkpointing, server=server,
              gpu_memory_utilization=cfg.serve.gpu_memory_utilization, sleep_level=cfg.serve.sleep_level,
              max_loras=cfg.serve.max_loras, gpu=gpu)
    b = budget(shape, s, size)
    if b.fits:
        return None
    items = ", ".join(f"{k} {gb(v)}" for k, v in b.items.items() if k not in ("KV cache / token", "vLLM asleep")
                      and v >= 0.05e9)
    length = (f"serve.max_model_len = {context}" if cfg.serve.max_model_len
              else f"{context} tokens (the model's context; serve.max_model_len unset)")
    said = f"needs about {gb(b.need)} GB of {what}'s {gb(size)} GB ({items})" if b.need > size else b.notes[0]
    found = fix(shape, s, size)
    if found is not None:
        changes = found[1]
        said_changes = ", ".join(changes[:-1]) + " and " + changes[-1] if len(changes) > 1 else changes[0]
        what_fits = f"it fits with {said_changes} (about {gb(budget(shape, found[0], size).need)} GB)"
    else:
        what_fits = ("no setting here makes it fit (train.gradient_checkpointing, train.micro_batch_size, "
                     "model.quantization, serve.gpu_memory_utilization, serve.max_model_len): a device with more "
                     "memory" + (", vLLM on a GPU of its own ([devices] serve and train)" if server == "vllm" else "")
                     + ", or train.shard = 'fsdp' over several GPUs")
    return (f"memory: {cfg.model.name} at {length} a call, train.micro_batch_size = {s.rows} rows a pass, "
            f"{said}; {what_fits} (docs/scaling.md, 'Memory on one device')")


def _model_config(name: str, path: str | None) -> Any | None:
    """The model's transformers configuration, read without loading (nor, for shape: names, building) it."""
    from lightning_sdk import models

    try:
        if name.startswith(models.SHAPE):
            from lightning_sdk.models import shapes

            return shapes.config(name)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path or models.resolve(name))
    except (OSError, ValueError, models.ModelLoadError):  # said where the model loads, in its own words
        return None


def _trainer_device(cfg: Config, gpus: tuple[int, ...]) -> tuple[str, float, bool] | None:
    """(what, bytes, is_gpu) of the device the trainer uses: its first placed GPU, or train.device; None for MPS
    and XPU, whose memory is not read here."""
    device = cfg.train.device
    if device == "cpu" and not gpus:
        return "this machine's RAM", float(_ram()), False
    if not (device == "auto" or device.startswith("cuda")):
        return None
    import torch

    if not torch.cuda.is_available():
        return ("this machine's RAM", float(_ram()), False) if device == "auto" else None
    index = gpus[0] if gpus else int(device.partition(":")[2] or 0)
    p = torch.cuda.get_device_properties(index)
    return f"GPU {index} ({p.name})", float(p.total_memory), True


def _ram() -> int:
    """This machine's memory, or its cgroup's limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def say_memory(cfg: Config, console: Any, model_path: str | None = None) -> str | None:
    """memory_warning's line, printed (a warning: the run goes on)."""
    line = memory_warning(cfg, model_path)
    if line:
        console.print(f"[yellow]{escape(line)}[/]", highlight=False, soft_wrap=True)
    return line
