"""Turning tracing on in a process: rollout spans to a sink, rollout context onto requests toward the gateway.

What the gateway needs to make each call's training record is only the rollout's context on the request
(`propagation`). Spans are for the rest: tools, framework steps and rewards, which agent frameworks record through
the global provider (`_adopt_global`), go to the store. The user's own tools (an OTLP collector, the application's
provider) get one trace per rollout: its root (`export_rollout`, made when the rollout is scored), the gateway's
record of each LLM call and the agent's spans beneath it. The OpenAI client is not instrumented: its spans would
repeat each call the gateway records.
"""

from __future__ import annotations

import atexit
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from lightning_sdk.tracing import context, export, propagation
from lightning_sdk.tracing.context import RolloutContext
from lightning_sdk.tracing.records import ATTEMPT, ROLLOUT_ID, TRACER_NAME, SpanRecord, SpanSink, to_span
from lightning_sdk.tracing.writer import StoreSpanProcessor


def install(sink: SpanSink, *, gateway_url: str | None = None, otlp_endpoint: str | None = None,
            outlets: Sequence[SpanProcessor] = ()) -> StoreSpanProcessor:
    """Send rollout spans to `sink`, and rollout context on every request toward `gateway_url` (the run's gateway).

    Spans get a private TracerProvider, so a user's own OpenTelemetry setup is neither replaced nor flooded.
    Agent frameworks that trace themselves through the *global* provider (AutoGen records each tool execution as
    an `execute_tool` span, ERROR when the tool raised) reach the store too: see `_adopt_global`. Calling it again
    swaps the sink (a new run in the same process).

    Rollout spans also go to an OTLP/HTTP collector at `otlp_endpoint` (a base URL; default: the
    OTEL_EXPORTER_OTLP_ENDPOINT environment variable, if set), to the application's own global provider, and to
    `outlets` (a remote worker's `ship.RolloutShipper`).
    """
    with _install_lock:
        if _state.processor is not None:
            _state.processor.shutdown()
        if _state.provider is None:
            # Always sampled: the store needs every span, whatever an application samples for its own.
            _state.provider = TracerProvider(sampler=ALWAYS_ON, id_generator=PrivateRandomIds())
            context.use_provider(_state.provider)
            # A provider keeps its processors for life: route through one whose target can be swapped.
            _state.provider.add_span_processor(_state.forward)
            _state.app_provider = _adopt_global(_state.provider)
            atexit.register(_shutdown)  # the exporters' last batch goes out before the process ends
        processor = StoreSpanProcessor(sink, exporters=export.exporters(_state.provider, _state.app_provider,
                                                                         otlp_endpoint, outlets))
        _state.forward.target = processor
        _state.processor = processor
        if gateway_url is not None:
            propagation.enable(gateway_url)
        return processor


class PrivateRandomIds(IdGenerator):
    """Span and trace ids from the OS's CSPRNG (`secrets`), as every id that decides what is stored is drawn.

    OpenTelemetry's default generator draws from the `random` module, whose state training code seeds and
    restores: a resumed run would draw the very ids it drew before the kill, and the store would see old ids for
    new spans. And a Mersenne Twister's next ids follow from 624 of its outputs: whoever saw enough ids could
    plant a span under one still to come.
    """

    def generate_span_id(self) -> int:
        return secrets.randbits(64) or 1  # 0 is the invalid span id

    def generate_trace_id(self) -> int:
        return secrets.randbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


def _adopt_global(provider: TracerProvider) -> TracerProvider | None:
    """Let spans that frameworks send to the global provider reach the store (only those inside a rollout are kept).

    With no global provider set, ours becomes it; with the application's own SDK provider, ours is added to its
    processors and its exporters keep working as before. Returns the application's provider (which then also
    receives our spans, see export.AppProvider), or None.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    elif isinstance(current, TracerProvider) and current is not provider:
        current.add_span_processor(_state.forward)
        return current
    return None


def flush(timeout_s: float = 30.0, *, exporters: bool = False) -> None:
    """Wait until every ended span is in the store; with `exporters`, also until the exporters sent them."""
    if _state.processor is None:
        return
    if not _state.processor.force_flush(int(timeout_s * 1000)):
        raise TimeoutError(f"span writer did not drain within {timeout_s}s")
    if exporters and not _state.processor.exporters.force_flush(int(timeout_s * 1000)):
        raise TimeoutError(f"span exporters did not drain within {timeout_s}s")


def _shutdown() -> None:
    if _state.processor is not None:
        _state.processor.shutdown()


def export_received(records: Sequence[SpanRecord], scope_name: str = "lightning_sdk.remote") -> None:
    """Spans recorded elsewhere and stored (a remote worker's, the gateway's call records) to this run's collector
    and the application's provider, as spans recorded here go (not to outlets: those ship a worker's own)."""
    processor = _state.processor
    if processor is None or not processor.exporters.processors or not records:
        return
    scope = InstrumentationScope(scope_name)
    processor.exporters.export([to_span(r, resource=_state.provider.resource, scope=scope) for r in records],
                               outlets=False)


def exporting() -> bool:
    """Whether spans go anywhere besides the store (a collector, the application's provider)."""
    return _state.processor is not None and bool(_state.processor.exporters.processors)


def export_rollout(ctx: RolloutContext, *, name: str, attributes: dict[str, Any], start_ns: int, end_ns: int,
                   error: str | None) -> None:
    """The rollout's own span, the root of its trace (`ctx.span_id`, the parent its calls and spans name), to this
    run's collector and the application's provider once the rollout is scored. The store keeps the rollout as its
    row, not as a span; a remote worker's root is exported by the run's server from the result it accepted."""
    processor = _state.processor
    if processor is None or not processor.exporters.processors:
        return
    record = SpanRecord(span_id=ctx.span_id, trace_id=ctx.trace_id or "0" * 32, parent_id=None,
                        rollout_id=ctx.rollout_id, attempt=ctx.attempt, component=None, name=name,
                        start_ns=start_ns, end_ns=end_ns, status="ERROR" if error else "OK", status_message=error,
                        attributes={ROLLOUT_ID: ctx.rollout_id, ATTEMPT: ctx.attempt, **attributes})
    span = to_span(record, resource=_state.provider.resource, scope=InstrumentationScope(TRACER_NAME))
    processor.exporters.export([span], outlets=False)


def writer_errors() -> list[str]:
    return list(_state.processor.errors) if _state.processor else []


def export_errors() -> list[str]:
    return list(_state.processor.exporters.errors) if _state.processor else []


class _Forward(SpanProcessor):
    def __init__(self) -> None:
        self.target: StoreSpanProcessor | None = None

    def on_start(self, span, parent_context=None):
        if self.target is not None:
            self.target.on_start(span, parent_context)

    def on_end(self, span):
        # An ExportedSpan is one of ours handed to the application's provider: the store has it already.
        if self.target is not None and not isinstance(span, export.ExportedSpan):
            self.target.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.target.force_flush(timeout_millis) if self.target is not None else True


@dataclass
class _State:
    provider: TracerProvider | None = None
    forward: _Forward = field(default_factory=_Forward)
    processor: StoreSpanProcessor | None = None
    app_provider: TracerProvider | None = None


_state = _State()
_install_lock = threading.Lock()
