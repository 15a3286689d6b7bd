"""What would otherwise fail after the run directory is written, checked before it is: where the run goes, the
backend, the devices. Each fault is a SetupError naming the key (the port is checked when the gateway binds it)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_sdk.config import Config
from lightning_sdk.errors import SetupError
from lightning_sdk.servers.select import resolved_backend

MIN_FREE_BYTES = 64 * 2**20  # below this a run cannot even write its first checkpoint of a tiny model


def preflight(cfg: Config, run_dir: Path) -> None:
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
    if cfg.train.max_staleness and cfg.serve.sleep_level and resolved_backend(cfg) == "vllm":
        raise SetupError(f"train.max_staleness = {cfg.train.max_staleness} updates while vLLM serves, so both "
                         f"must fit in memory at once, but serve.sleep_level = {cfg.serve.sleep_level} puts vLLM "
                         f"to sleep for each update: set serve.sleep_level = 0 (and serve.gpu_memory_utilization "
                         f"to leave the trainer room), or train.max_staleness = 0")
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
