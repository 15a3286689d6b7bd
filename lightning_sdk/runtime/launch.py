"""Where the run's processes go and how the trainer is started: the placement (placement.py; make_server starts
the servers by the same plan), the defaults it implies, the trainer's share of the CPU cores, and the trainer on
its devices."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from lightning_sdk.config import Config, Policy
from lightning_sdk.placement import Placement, gpu_environment, place, settle, trainer_device
from lightning_sdk.servers.select import cpu_threads, resolved_backend, visible_gpus

if TYPE_CHECKING:  # torch comes with the trainer, imported when a run starts
    from lightning_sdk.train.ranks import TrainerProcesses
    from lightning_sdk.train.trainer import GRPOTrainer


def place_run(cfg: Config, *, counted: bool = False) -> tuple[Placement, str | None]:
    """The run's placement, with the defaults it implies set on `cfg`, and its line for the run's first lines
    (None on the CPU with one server: nothing to say). `counted`: torch counts the GPUs even where the built-in
    server is on the CPU (visible_gpus otherwise answers 0 there, to say the run's first line before torch loads)."""
    placement = place(cfg, visible=visible_gpus(cfg, counted=counted), backend=resolved_backend(cfg))
    return placement, settle(cfg, placement)


def count_can_refuse(cfg: Config) -> bool:
    """Whether the GPUs' count can refuse `cfg` where visible_gpus skips it (the built-in server on the CPU, no
    [devices]): train.processes set above 1 for a trainer that may take GPUs, which place() refuses on fewer GPUs
    than processes. Counting imports torch (seconds), so only such a config counts before the run's first line."""
    t = cfg.train
    return ("processes" in t.model_fields_set and t.processes > 1
            and (t.device in ("auto", "cuda") or t.device.startswith("cuda:")))


def share_cores(stack: ExitStack, cfg: Config) -> None:
    """On the CPU, the trainer's share of the cores (the server has the rest) until `stack` closes."""
    split = cpu_threads(cfg)
    if split is not None and split[1] is not None:
        import torch

        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(split[1])


def start_trainer(cfg: Config, stack: ExitStack, model_path: str, policies: list[Policy] | None,
                  gpus: tuple[int, ...] = ()) -> GRPOTrainer | TrainerProcesses:
    """The run's trainer on the base model at `model_path`; `policies`: one adapter each (None: one adapter);
    `gpus`: the placement's for the trainer (visible indices; () = train.device). train.processes = 1: in this
    process, on the first of `gpus`; more: data-parallel processes (train/ranks.py), one GPU each, stopped when
    `stack` closes."""
    from lightning_sdk.train.ranks import one_or_more_processes

    train = cfg.train
    devices = None
    if gpus and train.device in ("auto", "cuda"):  # place() saw to one GPU for each process
        if train.processes == 1:
            train = train.model_copy(update={"device": trainer_device(train.device, gpus)})
        else:
            devices = [gpu_environment((g,))["CUDA_VISIBLE_DEVICES"] for g in gpus[:train.processes]]
    return one_or_more_processes(model_path, train, stack, devices=devices, quantization=cfg.model.quantization,
                                 dtype=cfg.model.dtype, seed=cfg.run.seed,
                                 total_steps=cfg.run.iterations * cfg.train.epochs, policies=policies,
                                 backend=resolved_backend(cfg))
