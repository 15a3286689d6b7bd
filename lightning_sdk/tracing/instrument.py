"""Turning tracing on in a process: instrument the OpenAI client once and route rollout spans to a sink.

The OpenAI instrumentor gets a private TracerProvider, so a user's own OpenTelemetry setup is neither replaced
nor flooded; spans that frameworks send to the global provider reach the store too (`_adopt_global`).
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from lightning_sdk.tracing import context, token_ids
from lightning_sdk.tracing.records import SpanSink
from lightning_sdk.tracing.writer import StoreSpanProcessor


def install(sink: SpanSink) -> StoreSpanProcessor:
    """Instrument the OpenAI client (once per process) and send rollout spans to `sink`.

    The OpenAI instrumentor gets a private TracerProvider, so a user's own OpenTelemetry setup is neither
    replaced nor flooded. Agent frameworks that trace themselves through the *global* provider (AutoGen records
    each tool execution as an `execute_tool` span, ERROR when the tool raised) reach the store too: see
    `_adopt_global`. Calling it again swaps the sink (a new run in the same process).
    """
    with _install_lock:
        if _state.processor is not None:
            _state.processor.shutdown()
        processor = StoreSpanProcessor(sink)
        if _state.provider is None:
            _state.provider = TracerProvider(id_generator=OsRandomIds())
            context.use_provider(_state.provider)
            # A provider keeps its processors for life: route through one whose target can be swapped.
            _state.provider.add_span_processor(_state.forward)
            _instrument(_state.provider)
            _adopt_global(_state.provider)
        _state.forward.target = processor
        _state.processor = processor
        return processor


class OsRandomIds(IdGenerator):
    """Span and trace ids from the OS's randomness (`secrets`), not Python's `random`.

    OpenTelemetry's default generator draws from `random`, whose state training code seeds and restores: a
    resumed run would draw the very ids it drew before the kill, and the store would see old ids for new spans.
    """

    def generate_span_id(self) -> int:
        return secrets.randbits(64) or 1  # 0 is the invalid span id

    def generate_trace_id(self) -> int:
        return secrets.randbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


def _adopt_global(provider: TracerProvider) -> None:
    """Let spans that frameworks send to the global provider reach the store (only those inside a rollout are kept).

    With no global provider set, ours becomes it; with the application's own SDK provider, ours is added to its
    processors and its exporters keep working as before.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    elif isinstance(current, TracerProvider) and current is not provider:
        current.add_span_processor(_state.forward)


def flush(timeout_s: float = 30.0) -> None:
    if _state.processor is not None and not _state.processor.force_flush(int(timeout_s * 1000)):
        raise TimeoutError(f"span writer did not drain within {timeout_s}s")


def writer_errors() -> list[str]:
    return list(_state.processor.errors) if _state.processor else []


class _Forward(SpanProcessor):
    def __init__(self) -> None:
        self.target: StoreSpanProcessor | None = None

    def on_start(self, span, parent_context=None):
        if self.target is not None:
            self.target.on_start(span, parent_context)

    def on_end(self, span):
        if self.target is not None:
            self.target.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.target.force_flush(timeout_millis) if self.target is not None else True


@dataclass
class _State:
    provider: TracerProvider | None = None
    forward: _Forward = field(default_factory=_Forward)
    processor: StoreSpanProcessor | None = None


_state = _State()
_install_lock = threading.Lock()


def _run_inline(coro: Any) -> None:
    """Run the instrumentor's request-attribute coroutine to its end without an event loop.

    opentelemetry-instrumentation-openai 0.62 runs it with `asyncio.run` on every *sync* call: a new event loop
    each time, about 1 ms, ten times the rest of the span's cost. The coroutine only suspends to upload base64
    images through a user-configured async uploader, which lightning-sdk never configures; if it does suspend,
    it is closed and the request attributes of that one span are lost (the instrumentor's own errors are
    swallowed the same way).
    """
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    logging.getLogger("lightning_sdk").warning("span request attributes skipped: the instrumentor awaited I/O")


class _DropSentinelWarnings(logging.Filter):
    """The instrumentor copies request kwargs onto spans, including openai's `omit`/`NOT_GIVEN` sentinels (which
    e.g. the Agents SDK passes); OpenTelemetry drops those values with one warning each, on every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("openai.Omit" in message or "openai.NotGiven" in message)


def _instrument(provider: TracerProvider) -> None:
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.instrumentation.openai.shared import chat_wrappers
    from wrapt import wrap_function_wrapper

    if hasattr(chat_wrappers, "run_async"):
        chat_wrappers.run_async = _run_inline
    logging.getLogger("opentelemetry.attributes").addFilter(_DropSentinelWarnings())

    # Ours first, so the instrumentor's wrapper ends up outside it and its span is current when ours runs.
    mod = "openai.resources.chat.completions"
    for name in ("Completions.create", "Completions.parse"):
        wrap_function_wrapper(mod, name, token_ids.sync_wrapper)
    for name in ("AsyncCompletions.create", "AsyncCompletions.parse"):
        wrap_function_wrapper(mod, name, token_ids.async_wrapper)
    # No W3C traceparent header on the agent's requests: the spans stay in our store, no server continues the
    # trace, and injecting it costs every call.
    OpenAIInstrumentor(enable_trace_context_propagation=False).instrument(tracer_provider=provider)
