"""The agent side of tracing: which rollout and which role the current code runs in, and `emit_reward`.

Rollout id, attempt and component travel in context variables (copied into threads by `asyncio.to_thread` and
the rollout worker), and the span processor stamps them on every span at start. This module needs only the
OpenTelemetry API: no SDK setup, no store, no torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from opentelemetry import trace

from lightning_sdk.agent import reward_value
from lightning_sdk.tracing.records import REWARD_NAME, REWARD_SPAN, REWARD_VALUE, TRACER_NAME


@dataclass(frozen=True)
class RolloutContext:
    rollout_id: str
    attempt: int = 1


_rollout: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("lightning_rollout", default=None)
_component: contextvars.ContextVar[str | None] = contextvars.ContextVar("lightning_component", default=None)
_provider: Any = None  # what reward spans are made with: see use_provider


@contextlib.contextmanager
def rollout_context(rollout_id: str, attempt: int = 1) -> Iterator[RolloutContext]:
    """Everything traced inside belongs to this rollout (the runtime wraps each episode in one)."""
    ctx = RolloutContext(rollout_id, attempt)
    token = _rollout.set(ctx)
    try:
        yield ctx
    finally:
        _rollout.reset(token)


def use_provider(provider: Any) -> None:
    """Make reward spans with `provider` (tracing.install's private one, whose processor feeds the store)."""
    global _provider
    _provider = provider


def current_rollout() -> RolloutContext | None:
    return _rollout.get()


def current_component() -> str | None:
    return _component.get()


class component:
    """Tag the LLM calls made inside with an agent role, so training can pick which roles it optimises.

    Use as `with ls.component("writer"):` or as a decorator on a sync or async function.
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"component name must be a non-empty string, got {name!r}")
        self.name = name
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> "component":
        self._tokens.append(_component.set(self.name))
        return self

    def __exit__(self, *exc) -> None:
        _component.reset(self._tokens.pop())

    def __call__(self, fn: Callable) -> Callable:
        name = self.name
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                with component(name):
                    return await fn(*args, **kwargs)
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with component(name):
                return fn(*args, **kwargs)
        return wrapper


def emit_reward(value: float, name: str = "intermediate") -> None:
    """Record an intermediate reward inside a rollout; it is credited to the LLM call made just before it.

    Outside a rollout (the agent run on its own) it checks the value and does nothing else.
    """
    value = reward_value(value, f"emit_reward(name={name!r}) got")
    if _rollout.get() is None:
        return
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=_provider)
    with tracer.start_as_current_span(REWARD_SPAN, attributes={REWARD_VALUE: value, REWARD_NAME: name}):
        pass
