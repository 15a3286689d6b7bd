"""Models of real families' shapes with random weights, built offline from their published configurations.

`shape:qwen2.5-0.5b` is a Hugging Face model directory with Qwen2.5-0.5B's architecture, widths, depth, attention
heads, vocabulary size and context length, random weights (seeded) and the project's small ChatML tokenizer: it
answers nothing, and exists to measure memory and time at a real shape through the same loading code as a hub
model (the trainer, the CPU server, vLLM and the benchmarks load it like any checkpoint). `shape:NAME@LAYERS` keeps
the first LAYERS decoder layers: every per-layer cost scales with depth, so a shallow copy measures a curve in
less time and memory. Built once into the model cache.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sdk.files import build_once

SHAPE = "shape:"
VERSION = 1  # bump when the build changes, so cached shapes are rebuilt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """One published configuration: the transformers config class and the values that make the shape."""

    config_class: str
    values: dict[str, Any] = field(default_factory=dict)


_QWEN2 = {"vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "use_sliding_window": False,
          "hidden_act": "silu", "attention_dropout": 0.0}
_QWEN3 = {**_QWEN2, "head_dim": 128, "max_position_embeddings": 40960, "tie_word_embeddings": True}
_LLAMA3 = {"vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
           "head_dim": 64, "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}

# From each model's config.json on its hub page (the instruct variants share the base model's shape).
FAMILIES: dict[str, Family] = {
    "qwen2.5-0.5b": Family("Qwen2Config", {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864,
                                           "num_hidden_layers": 24, "num_attention_heads": 14,
                                           "num_key_value_heads": 2, "max_position_embeddings": 32768,
                                           "tie_word_embeddings": True}),
    "qwen2.5-1.5b": Family("Qwen2Config", {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960,
                                           "num_hidden_layers": 28, "num_attention_heads": 12,
                                           "num_key_value_heads": 2, "max_position_embeddings": 32768,
                                           "tie_word_embeddings": True}),
    "qwen2.5-7b": Family("Qwen2Config", {**_QWEN2, "vocab_size": 152064, "hidden_size": 3584,
                                         "intermediate_size": 18944, "num_hidden_layers": 28,
                                         "num_attention_heads": 28, "num_key_value_heads": 4,
                                         "max_position_embeddings": 32768, "tie_word_embeddings": False}),
    "qwen3-0.6b": Family("Qwen3Config", {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                                         "num_hidden_layers": 28, "num_attention_heads": 16,
                                         "num_key_value_heads": 8}),
    "llama-3.2-1b": Family("LlamaConfig", {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192,
                                           "num_hidden_layers": 16, "num_attention_heads": 32,
                                           "num_key_value_heads": 8, "tie_word_embeddings": True}),
    "llama-3.1-8b": Family("LlamaConfig", {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                                           "num_hidden_layers": 32, "num_attention_heads": 32,
                                           "num_key_value_heads": 8, "head_dim": 128,
                                           "tie_word_embeddings": False}),
}


class ShapeError(ValueError):
    pass


def parse(name: str) -> tuple[str, int | None]:
    """`shape:NAME[@LAYERS]` -> (NAME, LAYERS or None: all of them), or ShapeError naming what was expected."""
    spec = name[len(SHAPE):]
    family, _, layers = spec.partition("@")
    if family not in FAMILIES:
        raise ShapeError(f"model {name!r}: unknown shape {family!r}; expected one of "
                         f"{', '.join(SHAPE + f for f in FAMILIES)} (optionally @LAYERS, e.g. {SHAPE}qwen2.5-0.5b@4)")
    if not layers:
        return family, None
    full = FAMILIES[family].values["num_hidden_layers"]
    if not layers.isdigit() or not 1 <= int(layers) <= full:
        raise ShapeError(f"model {name!r}: @{layers}: expected a number of layers from 1 to {full}")
    return family, int(layers)


def config(name: str) -> Any:
    """The transformers configuration of `shape:NAME[@LAYERS]` (nothing built)."""
    import transformers

    family, layers = parse(name)
    f = FAMILIES[family]
    values = dict(f.values)
    if layers is not None:
        values["num_hidden_layers"] = layers
    return getattr(transformers, f.config_class)(**values, dtype="bfloat16")


def parameters(name: str) -> int:
    """The number of parameters of `shape:NAME[@LAYERS]`, from its configuration (nothing built)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(name))
    return sum(p.numel() for p in model.parameters())


def ensure_built(name: str) -> Path:
    """The directory of `shape:NAME[@LAYERS]` in the model cache, built once (safe when several processes ask)."""
    from lightning_sdk.models.tiny import cache_dir

    family, layers = parse(name)
    target = cache_dir(f"shape-{family}{'' if layers is None else f'-{layers}l'}-v{VERSION}")
    start = time.monotonic()
    if build_once(target, lambda tmp: build(tmp, name),
                  lambda: log.info(f"building {name} (first use only, then cached in {target}): {family}'s "
                                   f"published shape with random weights and the project's tokenizer")):
        log.info(f"built {name} in {time.monotonic() - start:.0f} s")
    return target


def build(out: Path, name: str, seed: int = 0) -> Path:
    """Tokenizer + random-weight model of `name` into `out` (a Hugging Face model directory), in bfloat16 as the
    published checkpoints are."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_sdk.models.tiny import build_tokenizer

    corpus = [f"The {w} of {n} is {n * 7 % 100}." for n in range(200) for w in ("sum", "part", "rest")]
    tok = build_tokenizer(out, corpus, vocab_size=512)
    cfg = config(name)
    cfg.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    cfg.pad_token_id = tok.pad_token_id
    cfg.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(out)
    (out / "lightning_sdk_build.json").write_text(json.dumps({"name": name, "version": VERSION, "seed": seed}))
    return out
