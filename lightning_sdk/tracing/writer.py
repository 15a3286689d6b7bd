"""The span processor: stamps rollout context on each span, and a writer thread that puts spans in the store.

A thread keeps SQLite writes off the agent's path; `force_flush` waits until all queued spans are written,
which the runtime calls before it reads a phase's spans back.
"""

from __future__ import annotations

import collections
import threading
import time

from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from lightning_sdk.tracing.context import current_component, current_rollout
from lightning_sdk.tracing.export import Exporters
from lightning_sdk.tracing.records import AFTER_CALL, ATTEMPT, CLAIM, COMPONENT, ROLLOUT_ID, SpanSink, to_record


class StoreSpanProcessor(SpanProcessor):
    """Stamps rollout context on span start; on end, queues rollout spans for a writer thread.

    A thread keeps SQLite writes off the agent's path; `force_flush` waits until all queued spans are written,
    which the runtime calls before it reads a phase's spans back.

    Ending a span only appends it to a deque: no lock, no wake-up. Waking the writer for every span cost the
    agent's thread about a millisecond per call (the writer took the GIL right away and kept it while it wrote).
    The writer instead wakes every `interval` seconds, or at once on a flush, and writes what has gathered in one
    transaction.

    The writer also hands each span to `exporters` (an OTLP collector, the application's provider) after the
    store has it.
    """

    def __init__(self, sink: SpanSink, *, exporters: Exporters | None = None, max_batch: int = 512,
                 interval: float = 0.05):
        self._sink = sink
        self.exporters = exporters or Exporters([])
        self._max_batch = max_batch
        self._interval = interval
        self._spans: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._cond = threading.Condition()  # guards _busy; notified after every batch
        self._busy = False  # the writer holds spans taken off the deque but not yet written
        self._stopping = False
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="lightning-span-writer", daemon=True)
        self._thread.start()

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
            self._spans.append(span)  # deque.append is atomic: safe from any thread

    def _take(self) -> list[ReadableSpan]:
        batch = []
        with self._cond:
            while self._spans and len(batch) < self._max_batch:
                batch.append(self._spans.popleft())
            self._busy = bool(batch)
        return batch

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            while batch := self._take():
                try:
                    self._sink.write_spans([r for r in map(to_record, batch) if r is not None])
                except Exception as e:  # keep the writer alive; the runtime reports these loudly
                    self.errors.append(f"{type(e).__name__}: {e}")
                if self.exporters:
                    self.exporters.export(batch)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            with self._cond:
                self._cond.notify_all()
                if self._stopping:
                    return

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        with self._cond:
            while self._spans or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.set()
                self._cond.wait(min(left, self._interval))
        return True

    def shutdown(self) -> None:
        self.force_flush()
        with self._cond:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.exporters.shutdown()  # sends what the exporters still hold
