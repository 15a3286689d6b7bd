"""Small random-weight models of the real families, each with its family's chat format, built offline.

`family:qwen3` (and qwen2.5, llama3, mistral, gpt-oss, gemma3) is a Hugging Face model directory made from the
family's own transformers configuration class, with what sets its architecture apart kept (Qwen3's q/k norms,
gpt-oss's experts, attention sinks and sliding/full layers, Gemma 3's sliding window and its four norms per layer)
and its widths cut to a few hundred thousand parameters, random weights (seeded), and a byte-level BPE tokenizer
holding the family's special tokens and chat template (models.chat_formats). It answers nothing: it exists so that
every part that reads a family's format (the chat template, tool calls, reasoning, vLLM's parsers, LoRA's target
modules) meets the real one. `shape:` models (models.shapes) keep a family's full size instead. Built once into
the model cache.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sdk.files import build_once
from lightning_sdk.models import chat_formats
from lightning_sdk.models.tiny import ChatTokens

FAMILY = "family:"
VERSION = 1  # bump when the build changes, so cached models are rebuilt

log = logging.getLogger(__name__)

# Every family's widths: head_dim 64 since vLLM's CPU attention rejects smaller heads; 2 query heads sharing 1
# key/value head (grouped-query attention, as every family here uses).
SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 4096}
WINDOW = 64  # the sliding window of the families that have one: short, so a tool prompt reaches past it


@dataclass(frozen=True)
class Family:
    """One family: its transformers configuration class and values, its chat format, and the tokens its
    generation config stops at (a reply ends at any of them)."""

    config_class: str
    chat: ChatTokens
    stops: tuple[str, ...]
    values: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "qwen2.5": Family("Qwen2Config", chat_formats.QWEN25, ("<|im_end|>", "<|endoftext|>"),
                      {"rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
                       "use_sliding_window": False}),
    "qwen3": Family("Qwen3Config", chat_formats.QWEN3, ("<|im_end|>", "<|endoftext|>"),
                    {"rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
                     "use_sliding_window": False}),
    "llama3": Family("LlamaConfig", chat_formats.LLAMA3, ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                     {"rms_norm_eps": 1e-05, "tie_word_embeddings": True, "max_position_embeddings": 131072,
                      "rope_scaling": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}}),
    "mistral": Family("MistralConfig", chat_formats.MISTRAL, ("</s>",),
                      {"rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "sliding_window": None,
                       "tie_word_embeddings": False}),
    "gpt-oss": Family("GptOssConfig", chat_formats.GPT_OSS, ("<|return|>", "<|endoftext|>", "<|call|>"),
                      {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128,
                       "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                       "tie_word_embeddings": False}),
    "gemma3": Family("Gemma3TextConfig", chat_formats.GEMMA3, ("<eos>", "<end_of_turn>"),
                     {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                      "query_pre_attn_scalar": 64, "tie_word_embeddings": True}),
}

# What the tokenizer's vocabulary is learnt from: prose, numbers and the JSON of tool calls and results.
CORPUS = [f"The {w} of {n} and {n + 3} is {n * 7 % 100}. {{\"name\": \"calculator\", \"arguments\": "
          f"{{\"expression\": \"{n}*{n % 9}+1\"}}}} [calculator(expression=\"{n}\")] {{\"answer\": {n}}}"
          for n in range(200) for w in ("sum", "part", "rest")]


class FamilyError(ValueError):
    pass


def parse(name: str) -> str:
    """`family:NAME` -> NAME, or FamilyError naming what was expected."""
    family = name[len(FAMILY):]
    if family not in FAMILIES:
        raise FamilyError(f"model {name!r}: unknown family {family!r}; expected one of "
                          f"{', '.join(FAMILY + f for f in FAMILIES)}")
    return family


def config(name: str, vocab_size: int = 1024) -> Any:
    """The transformers configuration of `family:NAME` (nothing built)."""
    import transformers

    f = FAMILIES[parse(name)]
    return getattr(transformers, f.config_class)(**{**SMALL, "vocab_size": vocab_size, **f.values})


def ensure_built(name: str) -> Path:
    """The directory of `family:NAME` in the model cache, built once (safe when several processes ask)."""
    from lightning_sdk.models.tiny import cache_dir

    family = parse(name)
    target = cache_dir(f"family-{family}-v{VERSION}")
    build_once(target, lambda tmp: build(tmp, name),
               lambda: log.info(f"building {name} (first use only, then cached in {target}): a small {family} with "
                                f"random weights and its family's chat format"))
    return target


def build(out: Path, name: str, seed: int = 0) -> Path:
    """Tokenizer + random-weight model of `family:NAME` into `out` (a Hugging Face model directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_sdk.models.tiny import build_tokenizer

    f = FAMILIES[parse(name)]
    tok = build_tokenizer(out, CORPUS, vocab_size=512, chat=f.chat)
    cfg = config(name, vocab_size=len(tok))
    stops = [tok.convert_tokens_to_ids(t) for t in f.stops]
    cfg.eos_token_id = tok.convert_tokens_to_ids(f.chat.eos)
    cfg.pad_token_id = tok.pad_token_id
    cfg.bos_token_id = tok.bos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.generation_config.bos_token_id = cfg.bos_token_id
    model.save_pretrained(out)
    (out / "lightning_sdk_build.json").write_text(json.dumps({"name": name, "version": VERSION, "seed": seed}))
    return out
