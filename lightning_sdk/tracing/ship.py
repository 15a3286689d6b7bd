"""A remote worker's span outlet: each rollout's spans go to the Lightning server over OTLP/HTTP with the standard
`OTLPSpanExporter`, and `deliver(rollout_id)` returns only once the server answered 2xx for all of them.

That is what lets a worker report a rollout's result only after its spans are stored: the server builds the
rollout's transitions as soon as its result is in. A batch that fails (the server restarting, unreachable) is
sent again, with backoff, until the caller's deadline; past it the rollout's spans are dropped, and the worker
does not report it (the server re-runs it). Spans are kept per rollout, so one rollout's trouble never holds up
another's. Spans that end after their rollout was delivered (a hung agent thread) are dropped and counted: the
server would refuse them anyway.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from lightning_sdk.tracing.records import ROLLOUT_ID

MAX_BATCH = 64  # spans per request: LLM-call spans carry whole conversations; keeps requests far below the limit
_REMEMBERED = 10_000  # delivered rollouts remembered (to drop their late spans): a long-lived worker stays bounded


class RolloutShipper(SpanProcessor):
    """Fed finished spans by the span writer (tracing.install's `outlets`); see the module docstring."""

    def __init__(self, exporter: SpanExporter, *, max_batch: int = MAX_BATCH, backoff: tuple[float, float] = (0.5, 5.0)):
        self.exporter, self.max_batch, self.backoff = exporter, max_batch, backoff
        self._pending: dict[str, list[ReadableSpan]] = defaultdict(list)
        self._delivered: OrderedDict[str, None] = OrderedDict()  # delivered (or given up): later spans dropped
        self._lock = threading.Lock()
        self._send = threading.Lock()  # one request at a time through the exporter's HTTP session
        self.dropped_late = 0
        self.failed_sends = 0

    def on_end(self, span: ReadableSpan) -> None:
        rollout_id = (span.attributes or {}).get(ROLLOUT_ID)
        if rollout_id is None:
            return
        with self._lock:
            if rollout_id in self._delivered:
                self.dropped_late += 1
            else:
                self._pending[rollout_id].append(span)

    def deliver(self, rollout_id: str, timeout_s: float) -> bool:
        """Send this rollout's spans; True once the server acknowledged all of them, False if `timeout_s` passed
        first (then they are dropped). Call after `tracing.flush()`, which hands the writer's spans here."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            spans = self._pending.pop(rollout_id, [])
            self._delivered[rollout_id] = None
            if len(self._delivered) > _REMEMBERED:
                self._delivered.popitem(last=False)
        delay = self.backoff[0]
        while spans:
            batch = spans[: self.max_batch]
            with self._send:
                ok = self.exporter.export(batch) is SpanExportResult.SUCCESS
            if ok:
                del spans[: len(batch)]
                delay = self.backoff[0]
                continue
            self.failed_sends += 1
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(delay * 2, self.backoff[1])
        return True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is sent but by `deliver`: a rollout is delivered whole, when it ended

    def shutdown(self) -> None:
        self.exporter.shutdown()
