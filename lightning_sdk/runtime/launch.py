"""Where the trainer runs and how it is started: its share of the CPU cores, and the GRPO trainer itself."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from lightning_sdk.config import Config, Policy
from lightning_sdk.servers.select import cpu_threads, resolved_backend

if TYPE_CHECKING:  # torch comes with the trainer, imported when a run starts
    from lightning_sdk.train.trainer import GRPOTrainer


def share_cores(stack: ExitStack, cfg: Config) -> None:
    """On the CPU, the trainer's share of the cores (the server has the rest) until `stack` closes."""
    split = cpu_threads(cfg)
    if split is not None and split[1] is not None:
        import torch

        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(split[1])


def start_trainer(cfg: Config, model_path: str, policies: list[Policy] | None) -> GRPOTrainer:
    """The run's trainer on the base model at `model_path`; `policies`: one adapter each (None: one adapter)."""
    from lightning_sdk.train.trainer import GRPOTrainer

    return GRPOTrainer(model_path, cfg.train, quantization=cfg.model.quantization, dtype=cfg.model.dtype,
                       seed=cfg.run.seed, total_steps=cfg.run.iterations * cfg.train.epochs, policies=policies,
                       backend=resolved_backend(cfg))
