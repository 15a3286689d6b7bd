"""Where a run's spans go besides the store: an OTLP/HTTP collector, and the application's own TracerProvider.

Both are fed from the span writer thread with finished spans, so neither costs the agent's thread anything; the
OTLP exporter sits behind OpenTelemetry's BatchSpanProcessor (its own thread, batching, retries). A rollout is one
trace: its root is the rollout's own span (`invoke_agent <agent>`, with task, reward and status), beneath it each
LLM call once, as the gateway recorded it (`chat <model>`, gen_ai input and output messages), and the agent's spans.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from lightning_sdk.compat import span_processors
from lightning_sdk.tracing.records import messages

# What OTLPSpanExporter itself reads when no endpoint is given.
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_log = logging.getLogger("lightning_sdk")


class ExportedSpan(ReadableSpan):
    """A span on its way out; the store's forwarder on the application's provider ignores these (no loop)."""


def otlp_processor(endpoint: str | None) -> BatchSpanProcessor | None:
    """A batch processor exporting to `endpoint` (a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT), or to what the
    environment names; None when neither names a collector."""
    if endpoint is None and not any(os.environ.get(k) for k in ENDPOINT_ENV):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # Given a base URL the exporter does not add the signal path (it does for the environment variable).
    exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces" if endpoint else None)
    return BatchSpanProcessor(exporter)


def _text(message: dict[str, Any]) -> str:
    return "".join(str(p.get("content", "")) for p in message.get("parts") or () if p.get("type") == "text")


def gen_ai_view(span: ReadableSpan) -> ExportedSpan:
    """The span as exported. An LLM call (the gateway's record) keeps its gen_ai attributes, input and output
    messages included, and also says them as plain text in `input.value` / `output.value`: the attributes that
    Phoenix and Langfuse put in their input and output columns (Phoenix fills `output.value` from the response id
    and model otherwise)."""
    attrs = dict(span.attributes or {})
    if "gen_ai.input.messages" in attrs and "input.value" not in attrs:
        inputs = messages(attrs, "input")
        attrs["input.value"] = _text(inputs[-1]) if inputs else ""
        attrs["input.mime_type"] = "text/plain"
        outputs = messages(attrs, "output")
        if outputs:
            attrs["output.value"] = _text(outputs[0]) or json.dumps(outputs[0].get("parts", []))
            attrs["output.mime_type"] = "text/plain"
    return ExportedSpan(
        name=span.name, context=span.get_span_context(), parent=span.parent, resource=span.resource,
        attributes=attrs, events=span.events, links=span.links, kind=span.kind, status=span.status,
        start_time=span.start_time, end_time=span.end_time, instrumentation_scope=span.instrumentation_scope)


class AppProvider:
    """Hands our spans to the processors of the application's own global SDK TracerProvider.

    The OpenAI instrumentor traces into a private provider (so the store sees every call whatever the
    application samples); without this the application's exporters would receive none of a run's spans. Spans
    that frameworks made through the application's provider already went to its processors: those are skipped.
    """

    def __init__(self, app: TracerProvider, own: TracerProvider):
        self.app, self.own_resource = app, own.resource

    def on_end(self, span: ReadableSpan) -> None:
        if span.resource is not self.own_resource:
            return
        processors = span_processors(self.app)
        if processors is not None:
            processors.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # the application's provider is the application's to flush

    def shutdown(self) -> None:
        pass


class Exporters:
    """The span writer's outlets besides the store (run on the writer thread). `processors` (a collector, the
    application's provider) get the gen_ai view of each span; `outlets` (a remote worker's shipper to the run's
    server, which stores them) get spans exactly as a local store would keep them."""

    def __init__(self, processors: Sequence[Any], outlets: Sequence[Any] = ()):
        self.processors, self.outlets = list(processors), list(outlets)
        self.errors: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.processors or self.outlets)

    def export(self, spans: Sequence[ReadableSpan], *, outlets: bool = True) -> None:
        for span in spans:
            out = gen_ai_view(span) if self.processors else span
            for p in self.outlets if outlets else ():
                self._hand(p, span)
            for p in self.processors:
                self._hand(p, out)

    def _hand(self, p: Any, span: ReadableSpan) -> None:
        try:
            p.on_end(span)
        except Exception as e:  # an outlet must not stop the store's writer
            if len(self.errors) < 10:
                self.errors.append(f"{type(p).__name__}: {type(e).__name__}: {e}")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all([p.force_flush(timeout_millis) for p in self.outlets + self.processors])

    def shutdown(self) -> None:
        for p in self.outlets + self.processors:
            p.shutdown()


def exporters(own: TracerProvider, app: TracerProvider | None, endpoint: str | None,
              outlets: Sequence[SpanProcessor] = ()) -> Exporters:
    out: list[SpanProcessor | AppProvider] = []
    otlp = otlp_processor(endpoint)
    if otlp is not None:
        out.append(otlp)
        _log.info("exporting rollout spans over OTLP/HTTP to %s", endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
    if app is not None:
        out.append(AppProvider(app, own))
    return Exporters(out, outlets)
