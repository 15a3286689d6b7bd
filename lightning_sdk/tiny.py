"""A tiny chat model the project builds offline: the default demo and test model.

No model hub is reachable from a fresh machine, so `builtin:tiny-arith` is built on first use from data this
module generates: a byte-level BPE tokenizer with a ChatML chat template, and a small Llama pretrained on
single-digit addition by a teacher that knows the sums but is *chatty*: it gives the bare number only a quarter
of the time and otherwise wraps it ("The answer is 8.", "8.", "It is 8"). A task that asks for the bare number
then finds a model that can do it but mostly doesn't -- the situation RL fine-tuning of a real instruct model is
in -- and the reward can rise only by training.

The build is seeded and takes seconds on a CPU; the result is an ordinary Hugging Face model directory that
`AutoModelForCausalLM` / `AutoTokenizer` load like any downloaded checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

NAME = "tiny-arith"
VERSION = 2  # bump when the recipe changes, so stale caches are rebuilt

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


def cache_dir() -> Path:
    root = os.environ.get("LIGHTNING_SDK_CACHE") or Path.home() / ".cache" / "lightning_sdk"
    return Path(root) / "models" / f"{NAME}-v{VERSION}"


def ensure_built() -> Path:
    """Path of the built model, building it once (safe when several processes ask at the same time)."""
    target = cache_dir()
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
            try:
                build(tmp)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


REPLY_FORMATS = ("{}", "The answer is {}.", "{}.", "It is {}")  # the first is what the default task rewards


def _teacher_answer(rng: random.Random, a: int, b: int) -> str:
    return rng.choice(REPLY_FORMATS).format(a + b)


def _chat(q: str, answer: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [_chat(question(a, b), f.format(a + b)) for a, b in problems() for f in REPLY_FORMATS]
    corpus += ["The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()?!.,:;'\"\n"] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build(out: Path, *, seed: int = 0, steps: int = 300) -> Path:
    """Build tokenizer + model into `out` (a Hugging Face model directory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,  # a tied random-init head learns far slower under LoRA
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    all_problems = problems()
    model.train()
    for _ in range(steps):
        batch = [rng.choice(all_problems) for _ in range(128)]
        texts, prefixes = [], []
        for a, b in batch:
            prefix = f"<|im_start|>user\n{question(a, b)}<|im_end|>\n<|im_start|>assistant\n"
            prefixes.append(len(tok(prefix)["input_ids"]))
            texts.append(prefix + f"{_teacher_answer(rng, a, b)}<|im_end|>\n")
        enc = tok(texts, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for i, n in enumerate(prefixes):
            labels[i, :n] = -100  # learn the reply, not the question
        loss = model(**enc, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    (out / "lightning_sdk_build.json").write_text(
        json.dumps({"name": NAME, "version": VERSION, "seed": seed, "steps": steps,
                    "reply_formats": list(REPLY_FORMATS)}, indent=2)
    )
    return out
