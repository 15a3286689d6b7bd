"""A remote worker's span outlet: spans go to the Lightning server over OTLP/HTTP with the standard
`OTLPSpanExporter` as they end, and `deliver(rollout_id)` returns once the server acknowledged (2xx) every span
of that rollout.

Shipping as spans end keeps what a worker sent before it died (the server keeps an abandoned rollout's spans);
`deliver` lets a worker report a rollout's result only after its spans are stored, since the server builds the
rollout's transitions as soon as the result is in. A batch that fails (the server restarting or unreachable) is
sent again with backoff. A rollout whose spans are not all acknowledged by its deadline is given up: its spans
still queued are dropped and the worker does not report it (the server re-runs it), so no rollout's trouble
holds up the others for longer than its own deadline. Spans that end after their rollout was delivered (an agent
thread still running past its timeout) are dropped and counted: the server would refuse them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from lightning_sdk.tracing.records import ROLLOUT_ID

MAX_BATCH = 64  # spans per request: LLM-call spans carry whole conversations; keeps requests far below the limit
_REMEMBERED = 10_000  # delivered rollouts remembered (to drop their late spans): a long-lived worker stays bounded


class RolloutShipper(SpanProcessor):
    """Fed finished spans by the span writer (tracing.install's `outlets`); see the module docstring."""

    def __init__(self, exporter: SpanExporter, *, max_batch: int = MAX_BATCH, interval: float = 0.2,
                 backoff: tuple[float, float] = (0.25, 5.0)):
        self.exporter, self.max_batch, self.interval, self.backoff = exporter, max_batch, interval, backoff
        self._queue: deque[tuple[str, ReadableSpan]] = deque()
        self._outstanding: Counter[str] = Counter()  # per rollout: spans handed in, not yet acknowledged
        self._delivered: OrderedDict[str, None] = OrderedDict()  # delivered or given up: later spans dropped
        self._cond = threading.Condition()
        self._stopping = False
        self.dropped_late = 0
        self.failed_sends = 0
        self._thread = threading.Thread(target=self._run, name="lightning-span-shipper", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        rollout_id = (span.attributes or {}).get(ROLLOUT_ID)
        if rollout_id is None:
            return
        with self._cond:
            if rollout_id in self._delivered:
                self.dropped_late += 1
                return
            self._queue.append((rollout_id, span))
            self._outstanding[rollout_id] += 1

    def deliver(self, rollout_id: str, timeout_s: float) -> bool:
        """Wait until the server acknowledged every span of this rollout handed in so far: True; False if
        `timeout_s` passed first (its spans still queued are then dropped). Call it after `tracing.flush()`, which
        hands the writer's last spans here."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._delivered[rollout_id] = None
            if len(self._delivered) > _REMEMBERED:
                self._delivered.popitem(last=False)
            self._cond.notify_all()  # the sender goes now rather than at its next interval
            while self._outstanding.get(rollout_id, 0) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._queue = deque(item for item in self._queue if item[0] != rollout_id)
                    del self._outstanding[rollout_id]
                    return False
                self._cond.wait(left)
            self._outstanding.pop(rollout_id, None)
            return True

    def _run(self) -> None:
        delay = self.backoff[0]
        while True:
            with self._cond:
                if not self._queue:
                    if self._stopping:
                        return
                    self._cond.wait(self.interval)
                    continue
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            ok = self.exporter.export([span for _, span in batch]) is SpanExportResult.SUCCESS
            with self._cond:
                if ok:
                    for rollout_id, _ in batch:
                        if self._outstanding.get(rollout_id, 0) > 0:
                            self._outstanding[rollout_id] -= 1
                    delay = self.backoff[0]
                    self._cond.notify_all()
                    continue
                self.failed_sends += 1
                # back to the front, but for rollouts given up meanwhile
                self._queue.extendleft(reversed([item for item in batch if item[0] in self._outstanding]))
                if self._stopping:
                    return
                self._cond.wait(delay)  # the backoff; shutdown wakes it
                delay = min(delay * 2, self.backoff[1])

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """True once nothing is queued (spans being sent count as queued), or False at the timeout."""
        deadline = time.monotonic() + timeout_millis / 1000
        with self._cond:
            self._cond.notify_all()
            while sum(self._outstanding.values()) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self) -> None:
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=15)
        self.exporter.shutdown()
