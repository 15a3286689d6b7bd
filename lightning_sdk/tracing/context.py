"""The agent side of tracing: which rollout and which role the current code runs in, and `emit_reward`.

A rollout is an OpenTelemetry span context current in the agent's context: its trace id is the one the runtime
gave the rollout (and opened at the gateway), so every request the agent sends toward the gateway says which
rollout it belongs to (`propagation`). The component is a W3C baggage entry beside it. Both travel in context
variables (copied into threads by `asyncio.to_thread` and the rollout's own thread), and the span processor
stamps rollout id, attempt and component on every span at start. This module needs only the OpenTelemetry API:
no SDK setup, no store, no torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lightning_sdk.agent import reward_value
from lightning_sdk.tracing.records import AFTER_CALL, REWARD_NAME, REWARD_SPAN, REWARD_VALUE, TRACER_NAME

# What the agent side and the gateway speak, whatever propagators the application configured globally.
PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
COMPONENT_KEY = "lightning.component"  # the baggage entry `component` sets
ROLLOUT_KEY = "lightning.rollout"  # the baggage entry naming the rollout's trace id, for a span that starts a trace


@dataclass
class RolloutContext:
    rollout_id: str
    attempt: int = 1
    trace_id: str | None = None  # 32 hex digits, given by the runtime; None: one of our own
    claim: str | None = None  # a remote worker's claim secret, stamped on its spans
    last_call: str | None = None  # the latest LLM call (the gateway's record id) whose reply the agent saw
    span_id: str = ""  # 16 hex digits: the rollout's own span, the root of its trace (instrument.export_rollout)

    def saw_call(self, call_id: str) -> None:
        self.last_call = call_id


def new_span_id() -> str:
    """16 hex digits from the OS's CSPRNG (never 0, the invalid span id)."""
    return format(secrets.randbits(64) or 1, "016x")


_rollout: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("lightning_rollout", default=None)
_component: contextvars.ContextVar[str | None] = contextvars.ContextVar("lightning_component", default=None)
_provider: Any = None  # what reward spans are made with: see use_provider


@contextlib.contextmanager
def rollout_context(rollout_id: str, attempt: int = 1, *, trace_id: str | None = None, claim: str | None = None,
                    span_id: str | None = None) -> Iterator[RolloutContext]:
    """Everything inside belongs to this rollout (the runtime wraps each episode in one): spans, and LLM calls
    toward the gateway, which know it by `trace_id`. `span_id` is the rollout's own span (the root of its trace):
    a remote worker is given it with its claim, so that the run's server exports the root its spans name."""
    ctx = RolloutContext(rollout_id, attempt, trace_id or secrets.token_hex(16), claim,
                         span_id=span_id or new_span_id())
    # The rollout's span is current while the agent runs, so its calls and spans name it as their parent; it is
    # exported (with the reward) once the rollout is scored.
    span = NonRecordingSpan(SpanContext(int(ctx.trace_id, 16), int(ctx.span_id, 16), is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    # The baggage entry keeps the rollout known to the gateway under a framework's span that starts a new trace.
    otel_token = otel_context.attach(baggage.set_baggage(ROLLOUT_KEY, ctx.trace_id,
                                                         trace.set_span_in_context(span, otel_context.Context())))
    token = _rollout.set(ctx)
    try:
        yield ctx
    finally:
        _rollout.reset(token)
        otel_context.detach(otel_token)


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
        otel_token = otel_context.attach(baggage.set_baggage(COMPONENT_KEY, self.name))
        self._tokens.append((_component.set(self.name), otel_token))
        return self

    def __exit__(self, *exc) -> None:
        token, otel_token = self._tokens.pop()
        _component.reset(token)
        otel_context.detach(otel_token)

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
    ctx = _rollout.get()
    if ctx is None:
        return
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=_provider)
    attributes = {REWARD_VALUE: value, REWARD_NAME: name}
    if ctx.last_call is not None:
        attributes[AFTER_CALL] = ctx.last_call
    with tracer.start_as_current_span(REWARD_SPAN, attributes=attributes):
        pass
