"""The one check every LoRA adapter passes before it is saved, served or published: all its tensors are finite.

A single nan or inf in an adapter makes every completion it samples garbage (or the sampler raise), so the
trainer refuses to write one and the server refuses to load one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what peft's save_pretrained writes


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a nan or inf, or None when all are finite."""
    for name, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def nonfinite_in_adapter(path: str | Path) -> str | None:
    """`first_nonfinite` of a saved adapter directory's weights (None when it has no safetensors file: peft says
    what is missing when it loads)."""
    from safetensors.torch import load_file

    file = Path(path) / ADAPTER_WEIGHTS
    return first_nonfinite(load_file(file).items()) if file.is_file() else None
