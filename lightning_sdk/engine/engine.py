"""Batched generation over a Hugging Face causal LM, with LoRA adapters swapped in at run time.

The engine holds the tokenizer, the model and its adapters, and makes the model calls: a prefill of new
requests and one decode step of a batch, each sampling one token per row. Around it: `requests` (what is asked
and what comes back), `batch` (the rows and their KV cache), `sampling` (the next token and its log-prob, stop
strings) and `scheduler` (the generation thread and its continuous batching).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import resource
import threading
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import torch

from lightning_sdk import models
from lightning_sdk.constraint import Constraint
from lightning_sdk.engine.batch import DecodeBatch, Row
from lightning_sdk.engine.requests import (
    Choice,
    ChoiceDelta,
    GenerationRequest,
    GenerationResult,
    ModelNotFound,
    RequestError,
    Job,
)
from lightning_sdk.engine.sampling import find_stop, sample_next
from lightning_sdk.engine.scheduler import Scheduler
from lightning_sdk.grammar import Grammars, ThinkTokens
from lightning_sdk.models.adapter import nonfinite_in_adapter
from lightning_sdk.models import tool_parsers

log = logging.getLogger("lightning_sdk.servers")

MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_MODEL_LEN = 2048  # for a model whose config names no context length


class Engine:
    def __init__(self, model_path: str, *, dtype: str = "auto", quantization: str = "none",
                 max_batch_size: int = 64, max_model_len: int | None = None, seed: int = 0, device: str = "cpu",
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
        t0 = time.monotonic()
        self.device = torch.device(device)
        self.tokenizer = models.load_tokenizer(model_path)
        # Serve the base exactly as the trainer holds it (4bit for QLoRA), so sampled logprobs match its own.
        self.model = models.load_causal_lm(model_path, dtype=dtype, quantization=quantization, device=device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.max_batch_size = max_batch_size
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if max_model_len is None:  # the model's own context, as vLLM takes it
            max_model_len = limit or DEFAULT_MAX_MODEL_LEN
        elif limit is not None and max_model_len > limit:
            log.warning("max_model_len %d (serve.max_model_len) is more than the model holds (max_position_embeddings "
                        "%d); serving %d", max_model_len, limit, limit)
            max_model_len = limit
        self.max_model_len = max_model_len
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_ids = models.eos_ids(self.model, self.tokenizer)
        # the model's tool-call format and reasoning: serve.tool_call_parser / serve.reasoning_parser ('auto': read
        # from the model as vLLM's parsers are chosen), its tool-call arguments compact
        self.grammar = tool_parsers.server_grammar(model_path, tool_call_parser, reasoning_parser, compact=True)
        self.tool_parser, self.reasoning_parser = self.grammar.tool_parser, self.grammar.reasoning_parser
        self.think = ThinkTokens.of(self.tokenizer) if self.reasoning_parser == "qwen3" else None
        self.pad_id = self.tokenizer.pad_token_id
        # transformers 5 renamed `past_key_values` to `cache` (the old name is deprecated): use whichever exists.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._adapters: dict[str, str] = {}  # name -> path; touched on the generation thread only
        self._adapter_names: tuple[str, ...] = ()  # its snapshot for the event loop, replaced whole
        self._gen = torch.Generator().manual_seed(seed)
        self._tok_lock = threading.Lock()  # HF fast tokenizers raise "Already borrowed" under concurrent use
        self._token_text: dict[int, str] = {}
        self._grammars: Grammars | None = None  # made on the first constrained request
        # batches: batches started from nothing; prefills: prompt passes (one per batch plus one per group of
        # newcomers); joined: requests that joined rows already decoding.
        self.stats = {"requests": 0, "batches": 0, "prefills": 0, "joined": 0, "max_batch_rows": 0,
                      "generated_tokens": 0}
        self._scheduler = Scheduler(self._prefill, self._forward, self._adapter_context,
                                    max_batch_size=max_batch_size, stats=self.stats)
        log.info("loaded %s in %.1fs (%s on %s, max_model_len %d)", model_path, time.monotonic() - t0,
                 self.model.dtype, self.device, self.max_model_len)

    # ---- used from the event loop ----

    @property
    def adapters(self) -> list[str]:
        return list(self._adapter_names)

    def memory(self) -> dict[str, int | str | None]:
        """The device, the most memory this process has had allocated on it if it is a GPU, and its peak resident
        size (bytes)."""
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return {"device": str(self.device), "max_memory_allocated": peak, "max_rss": rss}

    def encode_chat(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: dict | None = None) -> list[int]:
        """Prompt token ids, exactly as the model's own chat template makes them (blocking: call it in a thread)."""
        try:
            with self._tok_lock:
                enc = self.tokenizer.apply_chat_template(
                    [_normalise_message(m) for m in messages],
                    tools=tools,
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    continue_final_message=continue_final_message,
                    tokenize=True,
                    return_dict=True,  # transformers 5 returns a BatchEncoding either way; ask for it explicitly
                    **(template_kwargs or {}),
                )
        except RequestError:
            raise
        except Exception as e:  # template errors (jinja raise_exception, bad roles) are the request's fault
            raise RequestError(f"cannot apply the chat template: {e}", "messages") from e
        return list(enc["input_ids"])

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A completions prompt's token ids, as the tokenizer makes them (blocking: call it in a thread)."""
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens included), as OpenAI logprobs report it."""
        text = self._token_text.get(token_id)
        if text is None:
            with self._tok_lock:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    async def compile(self, constraint: Constraint) -> Any:
        """The constraint compiled for this tokenizer, on the grammar's own threads (grammar.Grammars: bounded in
        size, time and compiles in flight); ConstraintError names the request's part that is over a limit or that
        the grammar engine cannot compile, GrammarBusy says the compile threads are busy."""
        if self._grammars is None:  # the event loop's thread only: no race
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids, lock=self._tok_lock,
                                      server=self.grammar)
        return await self._grammars.compile_async(constraint)

    def check(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise RequestError("the prompt is empty", "messages")
        if req.n > self.max_batch_size:
            raise RequestError(f"n={req.n} exceeds the server's max_batch_size {self.max_batch_size}", "n")
        if req.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1 (got {req.max_tokens})", "max_tokens")
        if len(req.prompt_ids) + req.max_tokens > self.max_model_len:
            raise RequestError(
                f"the prompt has {len(req.prompt_ids)} tokens and max_tokens is {req.max_tokens}: together more "
                f"than max_model_len {self.max_model_len}; shorten the messages or lower max_tokens", "max_tokens")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if req.adapter is not None and req.adapter not in self._adapter_names:
            raise ModelNotFound(f"The model `{req.adapter}` does not exist.")

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        job = self._submit(req, stream=False)
        return await job.future

    async def stream(self, req: GenerationRequest) -> AsyncIterator[ChoiceDelta | GenerationResult]:
        """Deltas as they are sampled, then the full result. Leaving early cancels the request."""
        job = self._submit(req, stream=True)
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, GenerationResult):
                    return
        finally:
            job.abandoned = True

    async def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        await self._scheduler.control(lambda: self._load_adapter(name, path, replace))

    async def unload_adapter(self, name: str) -> None:
        await self._scheduler.control(lambda: self._unload_adapter(name))

    def close(self) -> None:
        self._scheduler.close()
        if self._grammars is not None:
            self._grammars.close()

    def _submit(self, req: GenerationRequest, *, stream: bool) -> Job:
        self.check(req)
        job = Job(req, asyncio.get_running_loop(), stream)
        self._scheduler.submit(job)
        return job

    # ---- the generation thread (the scheduler calls these) ----

    def _prefill(self, jobs: list[Job]) -> DecodeBatch | None:
        """Prompt pass for new jobs, left-padded together; their first token is sampled. None if all finished."""
        rows = [Row(job, i, matcher=None if job.req.grammar is None else self._grammars.matcher(job.req.grammar),
                    thinking=job.req.grammar is not None and self.think is not None
                    and not self.think.prompt_ended(job.req.prompt_ids))
                for job in jobs for i in range(job.req.n)]
        self.stats["requests"] += len(jobs)
        self.stats["prefills"] += 1
        longest = max(len(r.req.prompt_ids) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for b, r in enumerate(rows):  # left padding: every row's next token goes in the last column
            p = r.req.prompt_ids
            ids[b, longest - len(p):] = torch.tensor(p)
            mask[b, longest - len(p):] = 1
        mask = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        batch = DecodeBatch(rows, None, mask, positions,
                       temps=torch.tensor([r.req.temperature for r in rows], dtype=torch.float32),
                       top_ps=torch.tensor([r.req.top_p for r in rows], dtype=torch.float32))
        self._forward(batch, ids)
        return batch if batch.rows else None

    def _forward(self, batch: DecodeBatch, ids: torch.Tensor) -> None:
        """One model step for the batch (prefill when it has no cache yet), one token sampled per row; finished
        rows leave the batch."""
        if batch.cache is not None:  # a decode step: one new column, one position further
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
            batch.positions = batch.positions[:, -1:] + 1
        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(batch.rows))
        out = self.model(input_ids=ids.to(self.device), attention_mask=batch.mask, position_ids=batch.positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: batch.cache})
        batch.cache = out.cache if hasattr(out, "cache") else out.past_key_values
        batch.positions = batch.positions[:, -1:]
        # Sampling stays on the CPU, where the requests' seeded generators are. A constrained row's logits are -inf
        # outside what its grammar allows next, before temperature and top-p: it samples from the policy
        # renormalised over those tokens and reports those log-probs (what the trainer's replay computes).
        logits = out.logits[:, -1, :].float().cpu()
        matchers = [None if r.thinking else r.matcher for r in batch.rows]
        if any(m is not None for m in matchers):
            self._grammars.mask_logits(logits, matchers)
        tokens, logps, top = sample_next(logits, batch.temps, batch.top_ps, batch.rows, self._gen)
        batch.tokens = tokens
        keep = [b for b, r in enumerate(batch.rows)
                if not self._append(r, int(tokens[b]), float(logps[b]), top[b] if top else None)]
        if len(keep) < len(batch.rows):
            batch.select(keep)

    def _load_adapter(self, name: str, path: str, replace: bool) -> None:
        from peft import PeftModel

        if name in self._adapters and not replace:
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        bad = nonfinite_in_adapter(path)
        if bad is not None:
            raise RequestError(f"cannot load lora adapter '{name}' from {path!r}: tensor {bad} holds nan or inf",
                               "lora_path")
        if name in self._adapters:
            self._unload_adapter(name)
        try:
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name)
            else:
                # The first adapter wraps the base model; later ones are added to the same wrapper.
                with warnings.catch_warnings():
                    # peft reads transformers' deprecated `is_gradient_checkpointing`: nothing a user can change
                    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                            category=FutureWarning)
                    self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name)
        except Exception as e:
            if isinstance(self.model, PeftModel) and name in self.model.peft_config:
                self.model.delete_adapter(name)  # drop what a half-finished load left behind
            raise RequestError(f"cannot load lora adapter '{name}' from {path!r}: {e}", "lora_path") from e
        self.model.eval()
        self._adapters[name] = path
        self._adapter_names = tuple(self._adapters)
        memory = self.memory()  # the peak through the collection before this hot-load (benchmarks/gpu_proof.py)
        peak = (f"GPU memory allocated {memory['max_memory_allocated'] / 2**20:.0f}"
                if memory["max_memory_allocated"] is not None else f"RSS {memory['max_rss'] / 2**20:.0f}")
        log.info("loaded lora adapter %s from %s (peak %s MiB)", name, path, peak)

    def _unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise ModelNotFound(f"The lora adapter '{name}' cannot be found.")
        if len(self._adapters) == 1:
            # PEFT refuses to delete the only adapter; take the LoRA layers out instead (no merge).
            self.model = self.model.unload()
        else:
            if name in self.model.active_adapters:  # activate another first: peft would pick one, and warn
                self.model.set_adapter(next(a for a in reversed(self._adapters) if a != name))
            self.model.delete_adapter(name)
        del self._adapters[name]
        self._adapter_names = tuple(self._adapters)
        log.info("unloaded lora adapter %s", name)

    def _adapter_context(self, adapter: str | None):
        if adapter is None:
            return self.model.disable_adapter() if self._adapters else contextlib.nullcontext()
        if adapter not in self._adapters:
            raise ModelNotFound(f"The model `{adapter}` does not exist.")
        self.model.set_adapter(adapter)
        return contextlib.nullcontext()

    def _append(self, row: Row, token: int, logprob: float, top: list[tuple[int, float]] | None) -> bool:
        """Record one sampled token; True when the row is finished (its job resolved if it was the last)."""
        if row.job.cancelled:
            return True  # nobody is waiting for it: drop the row
        req = row.req
        self.stats["generated_tokens"] += 1
        row.tokens.append(token)
        row.logprobs.append(logprob)
        constrained = not row.thinking
        if row.thinking and token in self.think.ends:  # the grammar starts: after </think>, at <tool_call>
            row.thinking, constrained = False, token != self.think.end
        if constrained and row.matcher is not None and not row.matcher.accept_token(token):
            log.error("token %d was sampled outside its request's grammar", token)  # the mask makes it impossible
        if req.top_logprobs:
            row.top.append(top or [])
        finish: str | None = None
        stop_reason: int | str | None = None
        if token in self.eos_ids and not req.ignore_eos:
            finish = "stop"
        elif token in req.stop_token_ids:
            finish, stop_reason = "stop", token
        streaming = row.job.events is not None
        if streaming or req.stop:  # these need the text after every token; the rest decode once at the end
            checked = len(row.text)
            row.text = self._decode(row.tokens, req)
            hit = find_stop(row.text, req.stop, checked) if finish is None else None
            if hit is not None:
                row.text, stop_reason, finish = row.text[:hit[0]], hit[1], "stop"
        if finish is None and len(row.tokens) >= req.max_tokens:
            finish = "length"
        if finish is not None and not (streaming or req.stop):
            row.text = self._decode(row.tokens, req)
        if streaming:
            self._stream_step(row, finish, stop_reason)
        if finish is None:
            return False
        row.job.choices[row.index] = Choice(row.index, row.tokens, row.text, row.logprobs,
                                            row.top if req.top_logprobs else None, finish, stop_reason)
        if row.job.done:
            row.job.finish(GenerationResult(req.prompt_ids, list(row.job.choices)))
        return True

    def _stream_step(self, row: Row, finish: str | None, stop_reason: int | str | None) -> None:
        end = len(row.text)
        if finish is None:
            # Hold back what could still turn out to be the start of a stop string, and a trailing
            # half-decoded character (byte-level tokens can split one).
            end -= max((len(s) for s in row.req.stop), default=1) - 1
            while end > row.sent and row.text[end - 1] == "\ufffd":
                end -= 1
        text = row.text[row.sent:end] if end > row.sent else ""
        row.sent = max(row.sent, end)
        row.job.emit(ChoiceDelta(row.index, [row.tokens[-1]], text, [row.logprobs[-1]],
                                 [row.top[-1]] if row.req.top_logprobs else None, finish, stop_reason))

    def _decode(self, tokens: list[int], req: GenerationRequest) -> str:
        if not req.skip_special_tokens and tokens and (tokens[-1] in self.eos_ids or tokens[-1] in req.stop_token_ids):
            tokens = tokens[:-1]  # the stop token is never in the text (vLLM's), its other special tokens are
        with self._tok_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=req.skip_special_tokens)


def _normalise_message(message: dict) -> dict:
    """OpenAI content parts -> one string, which is what chat templates expect."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                texts.append(part.get("text") or "")
            elif isinstance(part, str):
                texts.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"unsupported content part type {kind!r}; only text parts are", "messages")
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    return message

