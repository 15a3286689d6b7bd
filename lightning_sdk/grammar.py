"""Constraints (lightning_sdk/constraint.py) compiled with xgrammar, vLLM's default structured-output backend, for
one tokenizer: the sampler masks each step's logits with a matcher's token bitmask, and the trainer replays a
matcher over the sampled ids to get every position's bitmask, so both score a token under the same allowed set.

Only xgrammar's public API: GrammarCompiler, GrammarMatcher, allocate_token_bitmask, apply_token_bitmask_inplace.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lightning_sdk.constraint import TOOL_CLOSE, TOOL_OPEN, Constraint, ConstraintError

_ENGINE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


class Grammars:
    """Compiles constraints for one tokenizer (cached by their canonical text); thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar (xgrammar.CompiledGrammar); ConstraintError naming the request's part if it cannot
        be compiled (blocking: call it off the event loop)."""
        key = c.to_json()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(c)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _ENGINE_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConstraintError(f"{c.param}: the grammar engine cannot compile it: {message}", c.param) from None
        with self._lock:
            if len(self._cache) > 256:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

    def _compile(self, c: Constraint) -> Any:
        comp = self._compiler
        if c.kind in ("json_schema", "json_object"):  # compact JSON, as vLLM with disable_any_whitespace
            schema = json.dumps(c.spec if c.kind == "json_schema" else {"type": "object"})
            return comp.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        if c.kind == "choice":
            return comp.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in c.spec))
        if c.kind == "grammar":
            return comp.compile_grammar(c.spec)
        if c.kind == "tool_calls":
            return comp.compile_structural_tag(json.dumps(_tool_calls_tag(c.spec)))
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

    def replay(self, c: Constraint, completion_ids: Sequence[int]) -> torch.Tensor | None:
        """[len(completion_ids), words] int32 token bitmask of each position (what the matcher allowed before that
        token), or None if a sampled token is not one the grammar allows there (not sampled under it)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(c))
        bitmask = xgr.allocate_token_bitmask(len(completion_ids), self.vocab_size)
        for j, token in enumerate(completion_ids):
            if matcher.is_terminated():
                return None
            matcher.fill_next_token_bitmask(bitmask, j)
            if not matcher.accept_token(int(token)):
                return None
        return bitmask


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


def _tool_calls_tag(spec: dict) -> dict:
    """xgrammar's structural tag for `<tool_call>` blocks (one, or one or more separated by newlines), each a call
    of one of the tools, written as the chat template writes it: `{"name": "x", "arguments": {"a": 1}}`, the
    arguments compact JSON of the tool's schema with json.dumps' separators (what `tojson` renders)."""
    import xgrammar as xgr

    calls = [{"type": "tag", "begin": f'{TOOL_OPEN}{{"name": {json.dumps(t["name"])}, "arguments": ',
              "content": {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(
                  json.dumps(t["parameters"]), any_whitespace=False, separators=(", ", ": ")))},
              "end": "}" + TOOL_CLOSE} for t in spec["tools"]]
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if spec["one"]:
        return {"type": "structural_tag", "format": call}
    more = {"type": "star", "content": {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"},
                                                                         call]}}
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [call, more]}}
