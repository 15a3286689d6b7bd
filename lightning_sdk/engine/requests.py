"""What a generation request is and what comes back, and a request in flight on its way back to the caller.

The engine takes requests on the event loop and runs them on its generation thread; `Job` carries one across
and resolves it on the loop that submitted it, so neither side ever blocks the other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch


class RequestError(ValueError):
    """A request the engine cannot run; `param` names the offending field (an HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFound(LookupError):
    """The request named a model or adapter that is not loaded (an HTTP 404)."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # sample among the k most probable tokens; 0 or -1: all (vLLM's convention)
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0  # alternatives to report per token: the top k of the same distribution
    seed: int | None = None
    adapter: str | None = None  # None: the base model, adapters disabled
    ignore_eos: bool = False  # vLLM's sampling flag: go on past end-of-sequence until max_tokens
    grammar: Any = None  # a compiled constraint (Engine.compile): every choice is sampled under it
    skip_special_tokens: bool = True  # vLLM's flag: False keeps them in the text (a tool format's markers)


@dataclass
class Choice:
    index: int
    token_ids: list[int]  # every sampled id, the stop/eos token included
    text: str  # decoded (without special tokens unless the request keeps them), cut before a stop string
    logprobs: list[float]  # one per token id
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's field)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    choices: list[Choice]


@dataclass
class ChoiceDelta:
    """One streamed step of one choice: the token(s) sampled and the text they made visible."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Job:
    """A request in flight, with its way back to the event loop that submitted it."""

    def __init__(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop, stream: bool):
        self.req = req
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.events: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.choices: list[Choice | None] = [None] * req.n
        self.abandoned = False  # set by the client side when nobody waits for the answer any more
        self.generator = torch.Generator().manual_seed(req.seed) if req.seed is not None else None

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.choices)

    @property
    def cancelled(self) -> bool:
        return self.abandoned or self.future.cancelled()

    def emit(self, delta: ChoiceDelta) -> None:
        if self.events is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, delta)

    def finish(self, result: GenerationResult | BaseException) -> None:
        self.loop.call_soon_threadsafe(self._resolve, result)

    def _resolve(self, result: GenerationResult | BaseException) -> None:
        if self.events is not None:
            self.events.put_nowait(result)  # a result or an error ends the stream
        else:
            set_future(self.future, result)


def set_future(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
