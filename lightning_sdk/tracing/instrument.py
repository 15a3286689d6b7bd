"""Turning tracing on in a process: instrument the OpenAI client once and route rollout spans to a sink.

The OpenAI instrumentor gets a private TracerProvider, so a user's own OpenTelemetry setup is neither replaced
nor flooded; spans that frameworks send to the global provider reach the store too (`_adopt_global`).

What the agent's thread pays per call inside a rollout is kept small: plain calls are made beneath the
instrumentor and traced through it on the span writer thread (`calls`); streams and other calls it traces live,
with its spans recorded (`recorded`) and its attribute work deferred (`deferred`) to that thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from lightning_sdk.tracing import context, deferred, export, recorded, responses, token_ids
from lightning_sdk.tracing.records import SpanRecord, SpanSink, to_span
from lightning_sdk.tracing.writer import StoreSpanProcessor


def install(sink: SpanSink, *, otlp_endpoint: str | None = None,
            outlets: Sequence[SpanProcessor] = ()) -> StoreSpanProcessor:
    """Instrument the OpenAI client (once per process) and send rollout spans to `sink`.

    The OpenAI instrumentor gets a private TracerProvider, so a user's own OpenTelemetry setup is neither
    replaced nor flooded. Agent frameworks that trace themselves through the *global* provider (AutoGen records
    each tool execution as an `execute_tool` span, ERROR when the tool raised) reach the store too: see
    `_adopt_global`. Calling it again swaps the sink (a new run in the same process).

    Rollout spans also go to an OTLP/HTTP collector at `otlp_endpoint` (a base URL; default: the
    OTEL_EXPORTER_OTLP_ENDPOINT environment variable, if set), to the application's own global provider, and to
    `outlets` (a remote worker's `ship.RolloutShipper`).
    """
    with _install_lock:
        if _state.processor is not None:
            _state.processor.shutdown()
        if _state.provider is None:
            # Always sampled: the store needs every call, whatever an application samples for its own spans.
            _state.provider = TracerProvider(sampler=ALWAYS_ON, id_generator=PrivateRandomIds())
            context.use_provider(_state.provider)
            # A provider keeps its processors for life: route through one whose target can be swapped.
            _state.provider.add_span_processor(_state.forward)
            _instrument(_state.provider)
            _state.app_provider = _adopt_global(_state.provider)
            atexit.register(_shutdown)  # the exporters' last batch goes out before the process ends
        processor = StoreSpanProcessor(sink, exporters=export.exporters(_state.provider, _state.app_provider,
                                                                         otlp_endpoint, outlets))
        _state.forward.target = processor
        _state.processor = processor
        return processor


class PrivateRandomIds(IdGenerator):
    """Span and trace ids from a random generator of our own, seeded from the OS (again in a forked child).

    OpenTelemetry's default generator draws from the `random` module, whose state training code seeds and
    restores: a resumed run would draw the very ids it drew before the kill, and the store would see old ids for
    new spans. Drawing each id from the OS (`secrets`) avoids that too, but is a system call that releases the
    GIL twice per span: a writer thread waiting for the GIL takes it there, in the middle of the agent's call.
    """

    def __init__(self) -> None:
        self._random = random.Random()  # seeded from os.urandom
        os.register_at_fork(after_in_child=self._random.seed)

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1  # 0 is the invalid span id

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1

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


def export_received(records: Sequence[SpanRecord]) -> None:
    """Spans a remote worker sent (the run's store has them) to this run's collector and the application's
    provider, as spans recorded here go (not to outlets: they are a worker's, and these came from one)."""
    processor = _state.processor
    if processor is None or not processor.exporters.processors or not records:
        return
    scope = InstrumentationScope("lightning_sdk.remote")
    processor.exporters.export([to_span(r, resource=_state.provider.resource, scope=scope) for r in records],
                               outlets=False)


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

    def record(self, call) -> None:
        if self.target is not None:
            self.target.record(call)

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


def _fix_version_checks() -> None:
    """The instrumentor's `is_openai_v1()` parses two version strings with `packaging` on every call, several
    times per span; the installed openai's version does not change while the process runs."""
    import importlib

    from opentelemetry.instrumentation.openai import utils

    v1 = utils.is_openai_v1()
    for name in ("utils", "shared", "shared.chat_wrappers", "shared.completion_wrappers",
                 "shared.embeddings_wrappers", "shared.image_gen_wrappers", ""):
        module = importlib.import_module(f"opentelemetry.instrumentation.openai{'.' + name if name else ''}")
        if hasattr(module, "is_openai_v1"):
            module.is_openai_v1 = lambda: v1


def _defer_attributes(chat_wrappers: Any) -> None:
    """Run the instrumentor's request and response attribute work on the span writer thread (see `deferred`).

    Its chat wrapper looks these two module functions up on every call, so replacing them moves the work (prompt
    and completion serialisation, `model_as_dict`, ~25 validated `set_attribute` calls, its metrics) off the
    agent's thread, while the span, its timing, its status and its attribute names stay the instrumentor's.
    Calls outside a rollout keep the work inline: their spans reach no store. (A call replayed on the writer
    thread, see `calls`, defers it too: the attributes then go into the stored span unbounded, as live ones.)
    """
    handle_request, handle_response = chat_wrappers._handle_request, chat_wrappers._handle_response

    async def deferred_request(span, kwargs, instance):
        if not deferred.in_rollout(span):
            return await handle_request(span, kwargs, instance)
        kept = deferred.snapshot(kwargs)
        deferred.defer(span, lambda target: _run_inline(handle_request(target, kept, instance)))

    def deferred_response(response, span, *args, **kwargs):
        if not deferred.in_rollout(span):
            handle_response(response, span, *args, **kwargs)
        elif token_ids.holds_logprobs(response) and not chat_wrappers.should_emit_events():
            # It reads `model_dump()` of the response: the JSON data is the same (see `deferred.Frozen`).
            frozen = deferred.Frozen(response)
            deferred.defer(span, lambda target: handle_response(frozen.data(), target, *args, **kwargs))
        else:
            deferred.defer(span, lambda target: handle_response(response, target, *args, **kwargs))
        return response

    chat_wrappers._handle_request = deferred_request
    chat_wrappers._handle_response = deferred_response


def _instrument(provider: TracerProvider) -> None:
    import openai.resources.chat.completions as chat
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.instrumentation.openai.shared import chat_wrappers
    from wrapt import wrap_function_wrapper

    from lightning_sdk.tracing import calls

    if hasattr(chat_wrappers, "run_async"):
        chat_wrappers.run_async = _run_inline
    _defer_attributes(chat_wrappers)
    _fix_version_checks()
    logging.getLogger("opentelemetry.attributes").addFilter(_DropSentinelWarnings())

    mod = "openai.resources.chat.completions"
    sync_names, async_names = ("Completions.create", "Completions.parse"), ("AsyncCompletions.create",
                                                                          "AsyncCompletions.parse")
    originals = {name: getattr(getattr(chat, name.split(".")[0]), name.split(".")[1])
                 for name in sync_names + async_names}
    # Ours first, so the instrumentor's wrapper ends up outside it and its span is current when ours runs.
    for name in sync_names:
        wrap_function_wrapper(mod, name, token_ids.sync_wrapper)
    for name in async_names:
        wrap_function_wrapper(mod, name, token_ids.async_wrapper)
    # No W3C traceparent header on the agent's requests: the spans stay in our store, no server continues the
    # trace, and injecting it costs every call. Its spans inside a rollout are recorded on the agent's thread and
    # built on the writer thread (`recorded`).
    OpenAIInstrumentor(enable_trace_context_propagation=False).instrument(
        tracer_provider=recorded.RecordingTracerProvider(provider, _state.forward))
    responses.instrument(provider)  # the Responses API: our spans instead of the instrumentor's
    # Outermost: calls inside a rollout are made beneath the instrumentor and replayed through it on the span
    # writer thread (`calls`), whose clock it then reads.
    chat_wrappers.time = calls.ReplayClock()
    for name in sync_names:
        wrap_function_wrapper(mod, name, calls.sync_recorder(originals[name], _state.forward.record))
    for name in async_names:
        wrap_function_wrapper(mod, name, calls.async_recorder(originals[name], _state.forward.record))
