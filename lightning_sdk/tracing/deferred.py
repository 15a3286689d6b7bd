"""Work the agent's thread hands to the span writer thread, so a traced call costs it little.

Turning a request and its response into span attributes (the instrumentor's message serialisation and
`model_as_dict`, our token-id lists) is most of what tracing costs; none of it is needed before the span ends.
The calling thread keeps a reference to what it saw (`defer`), and the writer thread runs the work against a
stand-in span (`complete`), producing the finished span the store and the exporters receive. Only spans inside
a rollout defer anything: others go nowhere, so their attributes are never built.
"""

from __future__ import annotations

import contextvars
import json
from typing import Any, Callable

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Status, StatusCode

from lightning_sdk.tracing.records import ROLLOUT_ID

Work = Callable[["AttributeTarget"], None]

# span id -> work for the writer thread. One span is only ever touched by the thread that runs its call, and
# dict/list operations are atomic under the GIL: no lock on the agent's path.
_pending: dict[int, list[Work]] = {}

# The call the span writer thread is replaying through the instrumentor (`calls.RecordedCall`), else None.
replaying: contextvars.ContextVar[Any] = contextvars.ContextVar("lightning_replaying", default=None)


def in_rollout(span: Any) -> bool:
    attrs = getattr(span, "attributes", None)  # a NonRecordingSpan has none
    return bool(attrs) and ROLLOUT_ID in attrs


def defer(span: Any, work: Work) -> bool:
    """Run `work(target)` on the writer thread for this rollout span; False (and nothing kept) for other spans."""
    if not in_rollout(span):
        return False
    _pending.setdefault(span.get_span_context().span_id, []).append(work)
    return True


class Frozen:
    """A response kept as JSON text (what `model_dump()` gives, once loaded), or as it is if it is no model;
    `data()` on the writer thread.

    Deferred work that keeps a response keeps all its objects alive until the writer runs; the garbage collector
    traverses them meanwhile and promotes them to its oldest generation, whose full collections then come more
    often. Serialising costs less than that when the response holds objects per token (log-probs).
    """

    __slots__ = ("_text", "_data")

    def __init__(self, response: Any):
        if not hasattr(response, "model_dump_json") and hasattr(response, "parse"):
            response = response.parse()  # a `with_raw_response` call's APIResponse; parse() caches
        self._text: str | None = None
        self._data: Any = response
        if hasattr(response, "model_dump_json"):
            try:
                self._text, self._data = response.model_dump_json(warnings=False), None
            except Exception:  # not serialisable as JSON: keep the object
                pass

    def data(self) -> Any:
        if self._text is not None:
            self._data, self._text = json.loads(self._text), None
        return self._data


def snapshot(kwargs: dict, key: str = "messages") -> dict:
    """A request as the call saw it: agents append to their `messages` (Responses API: `input`) list right after a
    call returns."""
    kept = dict(kwargs)
    items = kept.get(key)
    if isinstance(items, list):
        kept[key] = [dict(m) if isinstance(m, dict) else m for m in items]
    return kept


def discard(span_id: int) -> None:
    _pending.pop(span_id, None)


class AttributeTarget:
    """Stands in for the span while deferred work runs: what the instrumentor's helpers call on a span."""

    def __init__(self, span: ReadableSpan):
        self.context = span.get_span_context()
        # Validated and cleaned as the SDK's span would (e.g. openai's NOT_GIVEN sentinels are dropped).
        self.attributes = BoundedAttributes(maxlen=None, immutable=False)
        self.trusted: dict[str, Any] = {}  # our own token-id lists: plain ints/floats, no per-element check
        self.status: Status | None = None

    def get_span_context(self):
        return self.context

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        if value is not None:  # as a live span: an attribute set to None is not an attribute
            self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        for k, v in attributes.items():
            self.set_attribute(k, v)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self.status = status if isinstance(status, Status) else Status(status, description)


def complete(span: ReadableSpan) -> ReadableSpan:
    """The span with its deferred attributes (writer thread). The span's own attributes win on a clash."""
    work = _pending.pop(span.get_span_context().span_id, None)
    if not work:
        return span
    target = AttributeTarget(span)
    for w in work:
        w(target)
    attributes = {**target.attributes, **target.trusted, **(span.attributes or {})}
    status = span.status
    if target.status is not None and target.status.status_code == StatusCode.ERROR and status.is_ok:
        status = target.status  # e.g. a response that carries an `error` field
    return rebuild(span, attributes=attributes, status=status)


def rebuild(span: ReadableSpan, *, name: str | None = None, attributes: dict[str, Any] | None = None,
            status: Status | None = None, cls: type[ReadableSpan] = ReadableSpan) -> ReadableSpan:
    return cls(
        name=span.name if name is None else name, context=span.get_span_context(), parent=span.parent,
        resource=span.resource, attributes=dict(span.attributes or {}) if attributes is None else attributes,
        events=span.events, links=span.links, kind=span.kind, status=span.status if status is None else status,
        start_time=span.start_time, end_time=span.end_time, instrumentation_scope=span.instrumentation_scope)
