"""Constraints (lightning_sdk/constraint.py) compiled with xgrammar, vLLM's default structured-output backend, for
one tokenizer: the sampler masks each step's logits with a matcher's token bitmask, and the trainer replays a
matcher over the sampled ids to get every position's bitmask, so both score a token under the same allowed set.

Only xgrammar's public API: GrammarCompiler, GrammarMatcher, allocate_token_bitmask, apply_token_bitmask_inplace.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from lightning_sdk.constraint import (DEFAULT_TOOL_FORMAT, TOOL_CLOSE, TOOL_OPEN, Constraint, ConstraintError,
                                      ServerGrammar, check_size, format_grammar, text_format)

_ENGINE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message

# A compile cannot be interrupted: constraint.check_size keeps each one short, these bound how many run and how long
# a request waits for one. Compiles run on their own threads, never the event loop's default executor, so a plain
# chat's encoding never queues behind them.
COMPILE_SECONDS = 30.0  # a compile that runs longer is refused and discarded; so is a wait this long for a thread
COMPILE_WORKERS = 2  # threads that compile
COMPILES_IN_FLIGHT = 8  # compiles running or waiting for a thread; past this a request is refused (busy) at once
# Compiled grammars kept, by xgrammar's own estimate of each one's memory (CompiledGrammar.memory_size_bytes: the
# grammar and its per-state token-mask cache, which dominates) plus its key's text; least recently used go first.
CACHE_BYTES = 256 * 2**20
CACHE_ENTRIES = 256
SLOW_REMEMBERED = 256  # constraints whose compile ran past the deadline, refused at once when asked again


class GrammarBusy(ConstraintError):
    """Every compile slot is taken, or the request's compile did not get a thread within the deadline: the server is
    busy, the constraint is not at fault (an HTTP 503)."""


class Grammars:
    """Compiles constraints for one tokenizer on threads of its own, bounded in size (constraint.check_size), time
    (`deadline_s`: a constraint that ran past it is refused at once when asked again), compiles in flight and cached
    bytes; cached by their canonical text; thread-safe. A constraint is compiled as its `server` (a recorded
    call's) applied it, else as `server` here says (the built-in server's own), else in `tool_format`
    (constraint.TOOL_FORMATS; a forced call, and JSON on gpt-oss, compile to that format's grammar) with free
    whitespace in structural tags (a record made before records said how)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], *, lock: Any = None,
                 deadline_s: float = COMPILE_SECONDS, workers: int = COMPILE_WORKERS,
                 in_flight: int = COMPILES_IN_FLIGHT, cache_bytes: int = CACHE_BYTES,
                 tool_format: str = DEFAULT_TOOL_FORMAT, server: ServerGrammar | None = None):
        self.vocab_size, self.server = vocab_size, server
        self.tool_format = server.tool_format if server is not None else tool_format
        self.deadline_s, self.max_in_flight, self.cache_limit = deadline_s, in_flight, cache_bytes
        self._tokenizer, self._stop_ids, self._tokenizer_lock = tokenizer, sorted(stop_ids), lock
        self._compiler: Any = None  # made on the first compile, on a compile thread (the vocabulary scan takes a while)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.cache_bytes = 0
        self._running: dict[str, Future] = {}  # key -> its compile, shared by every request that asks for it
        self._started: dict[str, float] = {}  # key -> when its compile got a thread
        # digests of the keys whose compile ran past the deadline (a key can be 256 KiB), the latest SLOW_REMEMBERED
        self._slow: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar (xgrammar.CompiledGrammar), blocking at most `deadline_s` for a compile thread and
        `deadline_s` more for the compile. ConstraintError naming the request's part if it is over a limit, compiles
        longer or cannot be compiled; GrammarBusy if no slot is free or no thread in time. None where the model's tool
        format samples `c` under no grammar."""
        if self._free(c):
            return None
        asked = time.monotonic()
        key, hit, job = self._start(c)
        while job is not None:
            try:
                return job.result(timeout=self._left(c, key, job, asked))
            except TimeoutError:
                continue
        return hit

    async def compile_async(self, c: Constraint) -> Any:
        """`compile` for the event loop: the loop only waits, the compile runs on this object's threads."""
        if self._free(c):
            return None
        asked = time.monotonic()
        key, hit, job = self._start(c)
        if job is None:
            return hit
        waited = asyncio.wrap_future(job)
        while True:
            try:  # shielded: the compile is shared by every request for the same constraint
                return await asyncio.wait_for(asyncio.shield(waited), self._left(c, key, job, asked))
            except TimeoutError:
                continue

    def _free(self, c: Constraint) -> bool:
        """True when this model's tool format samples `c` under no grammar (vLLM's "auto" for mistral, pythonic).
        A spec the format's grammar cannot be built from (a malformed stored record) is a ConstraintError."""
        try:
            return format_grammar(c, self._applied(c)[0]) is None
        except ConstraintError:
            raise
        except Exception as e:
            raise _cannot_compile(c, e) from None

    def _applied(self, c: Constraint) -> tuple[str, bool]:
        """(tool format, compact structural-tag JSON) that `c` is compiled in (see the class)."""
        server = c.server or self.server
        return (server.tool_format, server.compact) if server is not None else (self.tool_format, False)

    def _start(self, c: Constraint) -> tuple[str, Any, Future | None]:
        """(key, cached grammar, None) or (key, None, the compile to wait for: one running for the same key, or a
        new one). The size check and the key cost no more than the limits allow, so they run on the caller's thread."""
        check_size(c)
        key = c.to_json()
        with self._lock:
            slow = hashlib.sha256(key.encode()).digest()
            if slow in self._slow:  # a repeat would hold a compile thread as long again
                self._slow.move_to_end(slow)
                raise self._too_slow(c)
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return key, hit[0], None
            job = self._running.get(key)
            if job is not None:
                return key, None, job
            if len(self._running) >= self.max_in_flight:
                raise GrammarBusy(f"{c.param}: this server's limit of {self.max_in_flight} grammar compiles in "
                                  f"flight is reached; retry later", c.param)
            job = self._pool.submit(self._compile_timed, c, key)
            self._running[key] = job
        job.add_done_callback(lambda _: self._finished(key))
        return key, None, job

    def _finished(self, key: str) -> None:
        with self._lock:
            self._running.pop(key, None)
            self._started.pop(key, None)

    def _left(self, c: Constraint, key: str, job: Future, asked: float) -> float:
        """Seconds a request asked at `asked` may still wait for `job`: till `deadline_s` after it asked while the
        compile waits for a thread (then GrammarBusy: the server is busy, the constraint is not at fault), till
        `deadline_s` after the compile started once it runs (then ConstraintError). The compile goes on (it cannot
        be stopped) and holds its slot till it ends; it is cached only if it took less than the deadline."""
        if job.done():
            return 0.0
        now = time.monotonic()
        with self._lock:
            started = self._started.get(key)
        if started is None:
            if now - asked >= self.deadline_s:
                raise GrammarBusy(f"{c.param}: its grammar did not start compiling within this server's limit of "
                                  f"{self.deadline_s:g} s (the compile threads are busy); retry later", c.param)
            return asked + self.deadline_s - now
        if now - started >= self.deadline_s:
            raise self._remember_slow(c, key)
        return started + self.deadline_s - now

    def _too_slow(self, c: Constraint) -> ConstraintError:
        return ConstraintError(f"{c.param}: the grammar did not compile within this server's limit of "
                               f"{self.deadline_s:g} s; simplify it", c.param)

    def _remember_slow(self, c: Constraint, key: str) -> ConstraintError:
        """Remember `key` as past the deadline (the latest SLOW_REMEMBERED such keys); the error to raise."""
        slow = hashlib.sha256(key.encode()).digest()
        with self._lock:
            self._slow[slow] = None
            self._slow.move_to_end(slow)
            while len(self._slow) > SLOW_REMEMBERED:
                self._slow.popitem(last=False)
        return self._too_slow(c)

    def _compile_timed(self, c: Constraint, key: str) -> Any:
        """On a compile thread: compile, and cache the result unless it took longer than the deadline (then the
        request was refused, and a retry is refused the same way)."""
        started = time.monotonic()
        with self._lock:
            self._started[key] = started
        try:
            compiled = self._compile(c)
        except ConstraintError:
            raise
        except Exception as e:  # the engine's errors, and a malformed spec's (a stored record is untrusted)
            raise _cannot_compile(c, e) from None
        if time.monotonic() - started > self.deadline_s:
            raise self._remember_slow(c, key)
        size = int(compiled.memory_size_bytes) + len(key)
        with self._lock:
            if size <= self.cache_limit:
                self._cache[key] = (compiled, size)
                self.cache_bytes += size
                while self.cache_bytes > self.cache_limit or len(self._cache) > CACHE_ENTRIES:
                    _, (_, gone) = self._cache.popitem(last=False)
                    self.cache_bytes -= gone
        return compiled

    def close(self) -> None:
        """Start no more compiles (one running finishes on its thread)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def cached(self) -> int:
        """How many compiled grammars the cache holds (`cache_bytes`: their estimated memory)."""
        return len(self._cache)

    @property
    def running(self) -> int:
        """Compiles in flight: running, or waiting for a thread."""
        return len(self._running)

    def _xgr_compiler(self) -> Any:
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                with self._tokenizer_lock or contextlib.nullcontext():
                    info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                              stop_token_ids=self._stop_ids)
                # xgrammar's own cache is unbounded by default: this class's cache (bounded by bytes) is the one
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, c: Constraint) -> Any:
        comp = self._xgr_compiler()
        fmt, compact = self._applied(c)
        c = format_grammar(c, fmt)
        assert c is not None  # compile() answers None before it comes here (_free)
        if c.kind in ("json_schema", "json_object"):  # compact JSON, as vLLM with disable_any_whitespace
            schema = json.dumps(c.spec if c.kind == "json_schema" else {"type": "object"})
            return comp.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        if c.kind == "choice":
            return comp.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in c.spec))
        if c.kind == "grammar":
            return comp.compile_grammar(c.spec)
        if c.kind in ("tool_calls", "structural_tag"):  # vLLM compiles a tag with no whitespace setting of its own
            tag = tool_calls_tag(c.spec) if c.kind == "tool_calls" else c.spec
            return comp.compile_structural_tag(json.dumps(compact_tag(tag) if compact else tag))
        raise ValueError(f"unknown constraint kind {c.kind!r}")

    def matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def mask_logits(self, logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
        """-inf, in place, on each row's tokens its matcher does not allow next (rows without one untouched)."""
        import xgrammar as xgr

        rows = [b for b, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for k, b in enumerate(rows):
            matchers[b].fill_next_token_bitmask(bitmask, k)
        sub = logits[rows]
        xgr.apply_token_bitmask_inplace(sub, bitmask)
        logits[rows] = sub

    def replay(self, c: Constraint, completion_ids: Sequence[int], start: int = 0) -> torch.Tensor | None:
        """[len(completion_ids), words] int32 token bitmask of each position (what the matcher allowed before that
        token; every token before `start`, where the grammar begins: ThinkTokens), or None if a sampled token is not
        one the grammar allows there (not sampled under it)."""
        import xgrammar as xgr

        compiled = self.compile(c)
        bitmask = xgr.allocate_token_bitmask(len(completion_ids), self.vocab_size)  # every token allowed
        if compiled is None:
            return bitmask
        matcher = xgr.GrammarMatcher(compiled)
        for j, token in enumerate(completion_ids):
            if j < start:
                continue
            if matcher.is_terminated():
                return None
            matcher.fill_next_token_bitmask(bitmask, j)
            if not matcher.accept_token(int(token)):
                return None
        return bitmask


def _cannot_compile(c: Constraint, e: Exception) -> ConstraintError:
    message = _ENGINE_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__
    return ConstraintError(f"{c.param}: the grammar engine cannot compile it: {message}", c.param)


@dataclass(frozen=True)
class ThinkTokens:
    """Where a reasoning model's grammar starts, as vLLM's qwen3 reasoning parser decides it (structured output is
    not enforced while the model thinks): after `</think>`, or at a `<tool_call>` that ends the thinking first; from
    the first token when the prompt already ended it (an end token met before `<think>` or the turn's start,
    reading the prompt backwards: Qwen3's enable_thinking false)."""

    start: int
    ends: frozenset[int]  # </think>, <tool_call>
    end: int  # </think>: the one that is not itself constrained
    boundaries: frozenset[int]  # <|im_start|>, <|im_end|>

    @classmethod
    def of(cls, tokenizer: Any) -> "ThinkTokens | None":
        vocab = tokenizer.get_vocab()
        ids = {t: vocab.get(t) for t in ("<think>", "</think>", "<tool_call>", "<|im_start|>", "<|im_end|>")}
        if ids["<think>"] is None or ids["</think>"] is None:
            return None
        return cls(ids["<think>"], frozenset(i for i in (ids["</think>"], ids["<tool_call>"]) if i is not None),
                   ids["</think>"], frozenset(i for i in (ids["<|im_start|>"], ids["<|im_end|>"]) if i is not None))

    def prompt_ended(self, prompt_ids: Sequence[int]) -> bool:
        for token in reversed(prompt_ids):
            if token in self.ends:
                return True
            if token == self.start or token in self.boundaries:
                return False
        return False

    def grammar_start(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> int:
        """The first completion position the grammar constrains (len(completion_ids): none)."""
        if self.prompt_ended(prompt_ids):
            return 0
        for j, token in enumerate(completion_ids):
            if token in self.ends:
                return j + (token == self.end)
        return len(completion_ids)


def additive_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., vocab] float: 0 where a bitmask ([..., words] int32) allows a token, -inf where it does not."""
    import xgrammar as xgr

    flat = bitmask.reshape(-1, bitmask.shape[-1])
    out = torch.zeros(flat.shape[0], vocab_size, device=bitmask.device)
    xgr.apply_token_bitmask_inplace(out, flat)
    return out.view(*bitmask.shape[:-1], vocab_size)


def all_allowed(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, words] bitmask that allows every token."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def tool_calls_tag(spec: dict) -> dict:
    """xgrammar's structural tag for a request's tool calls (constraint.py's tool_calls spec), the one vLLM 0.32's
    hermes tool parser builds at `--tool-strict-level parameter` (vllm/tool_parsers/structural_tag_registry.py,
    _hermes_style_structural_tag, and the parser's _apply_structural_tag): each tool's call with and without the
    newlines inside `<tool_call>`, its arguments JSON of its parameter schema with free whitespace."""
    if "choice" not in spec:
        return _compact_tool_calls_tag(spec)
    begin, end = TOOL_OPEN.strip(), TOOL_CLOSE.strip()
    tags = [{"type": "tag", "begin": f'{opening}{{"name": "{t["name"]}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": t["parameters"]}, "end": "}" + closing}
            for t in spec["tools"] for opening, closing in ((TOOL_OPEN, TOOL_CLOSE), (begin, end))]
    if spec["choice"] == "auto" and "text" not in spec:
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [begin], "tags": tags,
                                                     "at_least_one": False, "stop_after_first": spec["one"]}}
    calls = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
             "stop_after_first": spec["one"]}
    if "text" in spec:  # "auto" with a response format: calls, or a reply in the format
        calls = {"type": "or", "elements": [calls, text_format(spec["text"]["kind"], spec["text"]["spec"])]}
    return {"type": "structural_tag", "format": calls}


def _compact_tool_calls_tag(spec: dict) -> dict:
    """A forced call's spec without `choice`, as stores written before it held them: the grammar the built-in
    server sampled those calls under, so they replay as sampled. `<tool_call>` blocks (one, or one or more separated
    by newlines), the arguments compact JSON of the tool's schema with json.dumps' separators."""
    calls = [{"type": "tag", "begin": f'{TOOL_OPEN}{{"name": {json.dumps(t["name"])}, "arguments": ',
              "content": _compact_json(t["parameters"]), "end": "}" + TOOL_CLOSE} for t in spec["tools"]]
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if spec["one"]:
        return {"type": "structural_tag", "format": call}
    more = {"type": "star", "content": {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"},
                                                                         call]}}
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [call, more]}}


def compact_tag(tag: Any) -> Any:
    """A structural tag with each JSON schema element in it made compact JSON (json.dumps' separators, as a chat
    template writes a call's arguments): how the built-in server samples tool calls (constraint.ServerGrammar)."""
    if isinstance(tag, list):
        return [compact_tag(x) for x in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") == "json_schema" and "json_schema" in tag:
        return _compact_json(tag["json_schema"])
    return {k: compact_tag(v) for k, v in tag.items()}


def _compact_json(schema: Any) -> dict:
    """A structural tag's element: JSON of `schema` (true: any JSON) with json.dumps' separators, no other
    whitespace."""
    import xgrammar as xgr

    return {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": ")))}
