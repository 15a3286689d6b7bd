"""The span processor: stamps rollout context on each span, and a writer thread that puts spans in the store.

A thread keeps SQLite writes off the agent's path; `force_flush` waits until all queued spans are written,
which the runtime calls before it reads a phase's spans back.
"""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from lightning_sdk.drain import Drain
from lightning_sdk.tracing.context import current_component, current_rollout
from lightning_sdk.tracing.export import Exporters
from lightning_sdk.tracing.records import AFTER_CALL, ATTEMPT, CLAIM, COMPONENT, ROLLOUT_ID, SpanSink, to_record


class StoreSpanProcessor(SpanProcessor):
    """Stamps rollout context on span start; on end, hands rollout spans to a writer thread (`drain.Drain`), which
    puts them in the store and then hands them to `exporters` (an OTLP collector, the application's provider).

    A thread keeps SQLite writes off the agent's path; `force_flush` waits until all ended spans are written,
    which the runtime calls before it reads a phase's spans back.
    """

    def __init__(self, sink: SpanSink, *, exporters: Exporters | None = None, max_batch: int = 512,
                 interval: float = 0.05):
        self._sink = sink
        self.exporters = exporters or Exporters([])
        self._drain: Drain[ReadableSpan] = Drain(self._write, name="lightning-span-writer", max_batch=max_batch,
                                                 interval=interval)

    @property
    def errors(self) -> list[str]:
        return self._drain.errors

    def on_start(self, span: Span, parent_context=None) -> None:
        ctx = current_rollout()
        if ctx is None:
            return
        span.set_attribute(ROLLOUT_ID, ctx.rollout_id)
        span.set_attribute(ATTEMPT, ctx.attempt)
        comp = current_component()
        if comp is not None:
            span.set_attribute(COMPONENT, comp)
        if ctx.last_call is not None:  # what the agent had seen when this began: orders failed tools causally
            span.set_attribute(AFTER_CALL, ctx.last_call)
        if ctx.claim is not None:
            span.set_attribute(CLAIM, ctx.claim)

    def on_end(self, span: ReadableSpan) -> None:
        # Only the check here: turning the span into a record happens on the writer thread.
        if span.attributes is not None and ROLLOUT_ID in span.attributes:
            self._drain.put(span)

    def _write(self, batch: list[ReadableSpan]) -> None:
        try:
            self._sink.write_spans([r for r in map(to_record, batch) if r is not None])
        finally:
            if self.exporters:
                self.exporters.export(batch)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._drain.flush(timeout_millis / 1000)

    def shutdown(self) -> None:
        self._drain.stop()
        self.exporters.shutdown()  # sends what the exporters still hold
