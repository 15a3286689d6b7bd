"""The OpenAI instrumentor's spans inside a rollout: recorded on the agent's thread, built on the span writer thread.

An SDK span costs the calling thread more than the rest of a traced call's layers together: a lock, validated
attribute maps, a sampler, a second ReadableSpan copy at `end()`, and a dozen objects kept alive until the writer
runs (which the garbage collector then traverses and promotes: its full collections grew with every traced call).
A `RecordedSpan` keeps what the instrumentor does to it (raw attributes, status, events) and its times; the writer
thread replays that onto a real SDK span (`readable`), so validation, limits and status rules stay the SDK's and
the store and the exporters receive the same ReadableSpan as before.

Outside a rollout the SDK's own span is used: nothing stores those spans, the instrumentor's inline work is kept.
Inside one a span is always recorded, whatever an application's sampler decided for its parent span: the store
needs every LLM call.
"""

from __future__ import annotations

import contextlib
from time import time_ns
from typing import Any, Iterator, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from lightning_sdk.tracing.context import current_rollout
from lightning_sdk.tracing.deferred import replaying

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # opentelemetry-api >= 1.39
_SAMPLED_RANDOM = TraceFlags(TraceFlags.SAMPLED | _RANDOM)


class RecordingTracerProvider:
    """What the instrumentor gets instead of our TracerProvider: its tracers record spans inside a rollout."""

    def __init__(self, provider: Any, processor: SpanProcessor):
        self.provider, self.processor = provider, processor

    def get_tracer(self, *args: Any, **kwargs: Any) -> "RecordingTracer":
        return RecordingTracer(self.provider.get_tracer(*args, **kwargs), self.processor)


class RecordingTracer(trace.Tracer):
    def __init__(self, sdk: SdkTracer, processor: SpanProcessor):
        self.sdk, self.processor = sdk, processor
        self.ids = sdk.id_generator
        self.limits = getattr(sdk, "_span_limits", None) or SpanLimits()
        self.random_roots = _RANDOM and sdk.id_generator.is_trace_id_random()

    def start_span(self, name: str, context: Any = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Any = None, links: Sequence[trace.Link] | None = (), start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> trace.Span:
        if links or current_rollout() is None:
            return self.sdk.start_span(name, context, kind, attributes, links, start_time, record_exception,
                                       set_status_on_exception)
        parent = trace.get_current_span(context).get_span_context()
        if parent.is_valid:
            flags = _SAMPLED_RANDOM if parent.trace_flags & _RANDOM else _SAMPLED
            ctx = SpanContext(parent.trace_id, self.ids.generate_span_id(), False, flags, parent.trace_state)
        else:
            parent = None
            ctx = SpanContext(self.ids.generate_trace_id(), self.ids.generate_span_id(), False,
                              _SAMPLED_RANDOM if self.random_roots else _SAMPLED)
        call = replaying.get()  # a call made earlier (`calls`): the span takes its times
        span = RecordedSpan(self, name, ctx, parent, kind, dict(attributes) if attributes else {},
                            call.start_ns if call else start_time or time_ns(), record_exception,
                            set_status_on_exception)
        if call:
            span.planned_end = call.end_ns
        self.processor.on_start(span, context)  # stamps the rollout id, attempt and component
        return span

    @contextlib.contextmanager
    def start_as_current_span(self, name: str, context: Any = None, kind: SpanKind = SpanKind.INTERNAL,
                              attributes: Any = None, links: Sequence[trace.Link] | None = (),
                              start_time: int | None = None, record_exception: bool = True,
                              set_status_on_exception: bool = True, end_on_exit: bool = True) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time, record_exception,
                               set_status_on_exception)
        with trace.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                            set_status_on_exception=set_status_on_exception) as current:
            yield current


class RecordedSpan(trace.Span):
    """A span whose SDK form is built later (`readable`) from what was done to it. One thread uses it until
    `end()`, which hands it to the span processor; the writer thread reads it after that."""

    __slots__ = ("tracer", "name", "context", "parent", "kind", "attributes", "start_time", "end_time",
                 "planned_end", "record_exception_on_exit", "status_on_exit", "ops")

    def __init__(self, tracer: RecordingTracer, name: str, context: SpanContext, parent: SpanContext | None,
                 kind: SpanKind, attributes: dict[str, Any], start_time: int, record_exception: bool,
                 set_status_on_exception: bool):
        self.tracer, self.name, self.context, self.parent, self.kind = tracer, name, context, parent, kind
        self.attributes = attributes  # raw: the SDK validates them on the writer thread
        self.start_time, self.end_time = start_time, None
        self.planned_end: int | None = None  # a replayed call's end
        self.record_exception_on_exit, self.status_on_exit = record_exception, set_status_on_exception
        self.ops: list[tuple[str, tuple]] | None = None  # status, events, links, in call order

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is None:
            self.attributes[key] = value  # cleaned as the SDK's span would, when the writer builds it

    def set_attributes(self, attributes: Any) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def _record(self, op: str, *args: Any) -> None:
        if self.end_time is None:
            if self.ops is None:
                self.ops = []
            self.ops.append((op, args))

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        self._record("add_event", name, dict(attributes) if attributes else None, timestamp or time_ns())

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        self._record("add_link", context, dict(attributes) if attributes else None)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self._record("set_status", status, description)

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def record_exception(self, exception: BaseException, attributes: Any = None, timestamp: int | None = None,
                         escaped: bool = False) -> None:
        # Formatted now, by the SDK's own code (it only calls add_event): the traceback grows as the exception
        # travels further up the stack.
        SdkSpan.record_exception(self, exception, attributes, timestamp, escaped)  # type: ignore[arg-type]

    def __exit__(self, exc_type: Any, exc_val: BaseException | None, exc_tb: Any) -> None:
        if exc_val is not None and self.is_recording():
            if self.record_exception_on_exit:
                self.record_exception(exc_val, escaped=True)
            if self.status_on_exit:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or self.planned_end or time_ns()
        self.tracer.processor.on_end(self)  # type: ignore[arg-type]

    def readable(self) -> ReadableSpan:
        """The SDK span this records, ended (on the span writer thread)."""
        sdk = self.tracer.sdk
        captured = _Capture()
        span = _Built(name=self.name, context=self.context, parent=self.parent, resource=sdk.resource,
                      attributes=self.attributes, kind=self.kind, span_processor=captured,
                      instrumentation_info=sdk.instrumentation_info, limits=self.tracer.limits,
                      instrumentation_scope=getattr(sdk, "_instrumentation_scope", None))
        span.start(start_time=self.start_time)
        for op, args in self.ops or ():
            getattr(span, op)(*args)
        span.end(end_time=self.end_time)
        return captured.span


def finished(span: Any) -> ReadableSpan:
    """What the span writer stores and exports for a span the processor queued."""
    return span.readable() if isinstance(span, RecordedSpan) else span


class _Built(SdkSpan):
    """The SDK span a RecordedSpan stands for (the SDK refuses to instantiate `Span` itself)."""


class _Capture(SpanProcessor):
    span: ReadableSpan

    def on_end(self, span: ReadableSpan) -> None:
        self.span = span
