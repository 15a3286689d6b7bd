"""Tiny chat models the project builds offline, each pretrained on what a `Teacher` says.

No model hub is reachable from a fresh machine, so the default demo and test model (`builtin:tiny-arith`, taught
by cookbook/arith/teacher.py) and every `tiny:<teacher.py>` model are built on first use: a byte-level BPE
tokenizer with a ChatML chat template, and a small Llama pretrained on the teacher's samples.

The build is seeded and runs on a CPU; the result is an ordinary Hugging Face model directory that
`AutoModelForCausalLM` / `AutoTokenizer` load like any downloaded checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union

from lightning_sdk.files import build_once

VERSION = 3  # bump when the recipe changes, so stale caches are rebuilt
# Positions a tiny model holds: RoPE has no position table, so they cost nothing until a prompt uses them, and the
# weights do not depend on the number (a build that says fewer differs from this recipe in config.json alone).
POSITIONS = 4096

log = logging.getLogger(__name__)  # the build's status lines (`lightning` shows lightning_sdk.* at INFO)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with tools the Qwen2.5 way: offered tools in the system turn, calls as <tool_call>{json}</tool_call> in
# the assistant turn, results as <tool_response> in a user turn. The tool list is compact (name, parameters,
# description) rather than full JSON schemas, so prompts stay as short as a model this small was taught on.
CHAT_TEMPLATE = (  # no "{%-" and no newline right after "%}": both would eat the template's own newlines
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}{% endif %}"
    "# Tools{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ '\n' + f.name }}({% for p in (f.parameters or {}).properties or {} %}{{ ', ' if not loop.first }}{{ p }}"
    "{% endfor %}): {{ f.description or '' }}{% endfor %}"
    "{{ '\n' }}Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>{{ '\n' }}"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call.function if call.function is defined else call %}"
    "{{ '\n' if message['content'] or not loop.first }}<tool_call>\n"
    "{\"name\": \"{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>{{ '\n' }}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Conversation:
    """A whole chat (OpenAI messages, tool calls with object arguments) whose assistant turns are all learned.

    One pass over the full text teaches every turn: cheaper than one (prompt, reply) pair per turn, each of which
    repeats the turns before it.
    """

    messages: list[dict]
    tools: list[dict] | None = None


Sample = Union[tuple[str, str], Conversation]


class Teacher(Protocol):
    """What a tiny model is pretrained on: replies to prompts, the prompts already rendered by CHAT_TEMPLATE.

    `samples(rng, n)` gives n samples: (prompt text, reply text) pairs, where the model learns the reply (then
    <|im_end|>), or `Conversation`s. `key` names the recipe in the cache: change it when the recipe changes.
    Optional, the tokenizer:
    - `vocab_size` (default 512) and `split_digits` (default True: numbers are tokens digit by digit).
    - `tokenizer_corpus(rng) -> list[str]`: the texts the vocabulary is learnt from (default: 1000 samples).
    Optional, for teachers whose model must copy words (a name out of a passage into a tool call):
    - `space_tokens = True`: spaces become tokens of their own, so a word is the same tokens wherever it stands
      (after a space, a quote or a newline). Without it byte-level BPE glues the space on ('ĠZel' vs 'Zel').
    - `warmup_steps` and `warmup_samples(rng, n)`: what the first steps train on instead of `samples`.
    """

    key: str

    def samples(self, rng: random.Random, n: int) -> list[Sample]: ...


def cache_dir(key: str) -> Path:
    root = os.environ.get("LIGHTNING_SDK_CACHE") or Path.home() / ".cache" / "lightning_sdk"
    return Path(root) / "models" / key


def model_name(teacher: Teacher) -> str:
    """The directory name of the model `teacher` teaches, in the cache and among prebuilt models."""
    return f"tiny-{teacher.key}-v{VERSION}"


def ensure_built(teacher: Teacher, *, steps: int = 300, batch: int = 128, prebuilt: Path | None = None,
                 what: str = "") -> Path:
    """Path of the model `teacher` teaches, building it once (safe when several processes ask at the same time).

    `what` names the model in the status line a build prints (e.g. "builtin:tiny-arith from cookbook/...").
    `prebuilt` is a folder of models already built (shipped beside their teacher): one named for this recipe is
    used as it is, since the name holds the recipe's key.
    """
    if prebuilt is not None and (prebuilt / model_name(teacher) / "config.json").exists():
        return prebuilt / model_name(teacher)
    target = cache_dir(model_name(teacher))
    if (target / "config.json").exists():
        _hold_positions(target)
        return target
    start = time.monotonic()

    def announce() -> None:
        # A first run otherwise sits silent here for 20 s (a free CPU) to 10+ min (a loaded 2-core machine).
        log.info(f"building the model {what or teacher.key} (first use only, then cached in {target}): no model "
                 f"hub is reachable offline, so a tokenizer and a small Llama are pretrained here on what its "
                 f"teacher says ({steps} steps of {batch}); the default model takes about 20 s on a free CPU and "
                 f"minutes on a busy one; the lines below say how long is left")

    if build_once(target, lambda tmp: build(tmp, teacher, steps=steps, batch=batch), announce):
        log.info(f"built {what or teacher.key} in {time.monotonic() - start:.0f} s")
    return target


def _hold_positions(model: Path) -> None:
    """A cached build whose config.json gives fewer than POSITIONS positions gets POSITIONS (its weights are this
    recipe's: see POSITIONS); written atomically, so a concurrent reader sees one config or the other."""
    path = model / "config.json"
    config = json.loads(path.read_text())
    if config.get("max_position_embeddings", POSITIONS) >= POSITIONS:
        return
    config["max_position_embeddings"] = POSITIONS
    tmp = path.with_name(f".config.json.{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)


def render(messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True) -> str:
    """CHAT_TEMPLATE applied without a tokenizer (teachers need prompts before the tokenizer exists)."""
    return _template().render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


@functools.cache
def _template():
    import jinja2

    # The settings transformers renders chat templates with.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE)


@dataclass(frozen=True)
class ChatTokens:
    """A chat format's tokens: the special ones (control tokens, dropped when a reply is decoded with
    skip_special_tokens), the plain added ones (one token each, but kept in decoded text, as Qwen's <tool_call> and
    <think> are: a parser reads them there), which of them end, pad and open a text, and the chat template."""

    special: tuple[str, ...]
    eos: str
    pad: str
    template: str
    bos: str | None = None
    plain: tuple[str, ...] = ()


CHATML = ChatTokens(special=tuple(SPECIAL_TOKENS), eos="<|im_end|>", pad="<|endoftext|>", template=CHAT_TEMPLATE)


def build_tokenizer(out: Path, corpus: list[str], *, vocab_size: int, split_digits: bool = False,
                    space_tokens: bool = False, chat: ChatTokens = CHATML):
    """A byte-level BPE learnt from `corpus` (vocab_size counts the special tokens), with `chat`'s tokens and
    template, saved into `out`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = corpus + ["The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()?!.,:;'\"\n"] * 4
    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.ByteLevel(add_prefix_space=False)]
    if space_tokens:  # see Teacher
        splits.insert(0, pre_tokenizers.Split(" ", behavior="isolated"))
    if split_digits:  # teacher models see numbers digit by digit, so copying one from the prompt is the same tokens
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = splits[0] if len(splits) == 1 else pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chat.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if chat.plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat.plain])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=chat.eos,
        pad_token=chat.pad,
        bos_token=chat.bos,
        additional_special_tokens=[t for t in chat.special if t not in (chat.eos, chat.pad, chat.bos)],
    )
    fast.chat_template = chat.template
    fast.save_pretrained(out)
    return fast


def _labelled(sample: Sample) -> tuple[str, list[tuple[int, int]]]:
    """A sample as (text, the character spans the model learns): each reply with its <|im_end|>."""
    if isinstance(sample, Conversation):
        text = render(sample.messages, sample.tools, add_generation_prompt=False)
        spans = []
        for k, m in enumerate(sample.messages):
            if m["role"] == "assistant":
                start = len(render(sample.messages[:k], sample.tools))
                end = len(render(sample.messages[:k + 1], sample.tools, add_generation_prompt=False))
                spans.append((start, end))
        return text, spans
    prefix, reply = sample
    return prefix + f"{reply}<|im_end|>\n", [(len(prefix), len(prefix) + len(reply) + len("<|im_end|>\n"))]


def build(out: Path, teacher: Teacher, *, seed: int = 0, steps: int = 300, batch: int = 128) -> Path:
    """Build tokenizer + model into `out` (a Hugging Face model directory), taught by `teacher`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The teacher's own vocabulary, from its own prompts and replies unless it gives the texts.
    if callable(getattr(teacher, "tokenizer_corpus", None)):
        corpus = teacher.tokenizer_corpus(random.Random(seed + 1))
    else:
        corpus = [_labelled(s)[0] for s in teacher.samples(random.Random(seed + 1), 1000)]
    tok = build_tokenizer(out, corpus, vocab_size=int(getattr(teacher, "vocab_size", 512)),
                          split_digits=bool(getattr(teacher, "split_digits", True)),
                          space_tokens=bool(getattr(teacher, "space_tokens", False)))
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
        max_position_embeddings=POSITIONS,
        tie_word_embeddings=False,  # a tied random-init head learns far slower under LoRA
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    warmup = int(getattr(teacher, "warmup_steps", 0))
    began, every = time.monotonic(), max(steps // 10, 1)
    for step in range(steps):
        if step and step % every == 0:  # a line per 10%: readable in a log file, unlike a progress bar
            spent = time.monotonic() - began
            log.info(f"  pretraining step {step}/{steps}, {spent:.0f} s so far, about "
                     f"{spent * (steps - step) / step:.0f} s left")
        draw = teacher.warmup_samples if step < warmup else teacher.samples
        texts, learned = zip(*(_labelled(s) for s in draw(rng, batch)))
        enc = tok(list(texts), return_tensors="pt", padding=True, return_offsets_mapping=True)
        starts = enc.pop("offset_mapping")[..., 0]  # where each token starts in its text
        learn = torch.zeros_like(enc["attention_mask"], dtype=torch.bool)  # the replies, not the questions
        for i, spans in enumerate(learned):
            for start, end in spans:
                learn[i] |= (starts[i] >= start) & (starts[i] < end)
        labels = torch.where(learn & enc["attention_mask"].bool(), enc["input_ids"], -100)
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
        json.dumps({"name": f"tiny-{teacher.key}", "version": VERSION, "seed": seed, "steps": steps,
                    "batch": batch}, indent=2)
    )
    return out
