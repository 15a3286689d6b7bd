"""What an agent's episode leaves behind: OpenTelemetry spans, tagged with their rollout, sent to a store.

`opentelemetry-instrumentation-openai` records each OpenAI-client call as a span (prompt, completion, model,
usage). It does not record token ids, so a small wrapper, installed *inside* the instrumentor's wrapper, reads
the exact ids and log-probs the server returned (vLLM's `prompt_token_ids` / `choices[].token_ids` fields, which
the built-in server returns too) and puts them on the current span. Nothing is re-tokenized.

Rollout id, attempt and component travel in context variables (copied into threads by `asyncio.to_thread`),
and a span processor stamps them on every span at start. Only spans that belong to a rollout are kept.
Agent-side code (`component`, `emit_reward`) needs only the OpenTelemetry API: no torch, no server.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.trace import StatusCode

# Our attributes, namespaced as OpenTelemetry's conventions ask for non-standard ones.
ROLLOUT_ID = "lightning.rollout.id"
ATTEMPT = "lightning.rollout.attempt"
COMPONENT = "lightning.component"
PROMPT_IDS = "lightning.llm.prompt_token_ids"
COMPLETION_IDS = "lightning.llm.completion_token_ids"  # choice 0: the one an agent reads
COMPLETION_LOGPROBS = "lightning.llm.completion_logprobs"
REWARD_VALUE = "lightning.reward.value"
REWARD_NAME = "lightning.reward.name"
REWARD_SPAN = "lightning.reward"
TRACER_NAME = "lightning_sdk"


@dataclass(frozen=True)
class RolloutContext:
    rollout_id: str
    attempt: int = 1


_rollout: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("lightning_rollout", default=None)
_component: contextvars.ContextVar[str | None] = contextvars.ContextVar("lightning_component", default=None)


@contextlib.contextmanager
def rollout_context(rollout_id: str, attempt: int = 1) -> Iterator[RolloutContext]:
    """Everything traced inside belongs to this rollout (the runtime wraps each episode in one)."""
    ctx = RolloutContext(rollout_id, attempt)
    token = _rollout.set(ctx)
    try:
        yield ctx
    finally:
        _rollout.reset(token)


def current_rollout() -> RolloutContext | None:
    return _rollout.get()


class component:
    """Tag the LLM calls made inside with an agent role, so training can pick which roles it optimises.

    Use as `with ls.component("writer"):` or as a decorator on a sync or async function.
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"component name must be a non-empty string, got {name!r}")
        self.name = name
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> "component":
        self._tokens.append(_component.set(self.name))
        return self

    def __exit__(self, *exc) -> None:
        _component.reset(self._tokens.pop())

    def __call__(self, fn: Callable) -> Callable:
        name = self.name
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                with component(name):
                    return await fn(*args, **kwargs)
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with component(name):
                return fn(*args, **kwargs)
        return wrapper


def emit_reward(value: float, name: str = "intermediate") -> None:
    """Record an intermediate reward inside a rollout; it is credited to the LLM call made just before it.

    Outside a rollout (the agent run on its own) it checks the value and does nothing else.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"emit_reward({value!r}, name={name!r}): expected a finite number")
    if _rollout.get() is None:
        return
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=_state.provider)
    with tracer.start_as_current_span(REWARD_SPAN, attributes={REWARD_VALUE: float(value), REWARD_NAME: name}):
        pass


# ----------------------------------------------------------------------------------------------- span records

@dataclass
class SpanRecord:
    """A finished span as the store keeps it."""

    span_id: str
    trace_id: str
    parent_id: str | None
    rollout_id: str
    attempt: int
    component: str | None
    name: str
    start_ns: int
    end_ns: int
    status: str  # "OK" | "ERROR" | "UNSET"
    status_message: str | None
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_error(self) -> bool:
        return self.status == "ERROR"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


def to_record(span: ReadableSpan) -> SpanRecord | None:
    attrs = dict(span.attributes or {})
    rollout_id = attrs.get(ROLLOUT_ID)
    if rollout_id is None:
        return None
    ctx = span.get_span_context()
    return SpanRecord(
        span_id=format(ctx.span_id, "016x"),
        trace_id=format(ctx.trace_id, "032x"),
        parent_id=format(span.parent.span_id, "016x") if span.parent else None,
        rollout_id=str(rollout_id),
        attempt=int(attrs.get(ATTEMPT, 1)),
        component=attrs.get(COMPONENT),
        name=span.name,
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        status=span.status.status_code.name,
        status_message=span.status.description,
        attributes={k: _plain(v) for k, v in attrs.items()},
        events=[{"name": e.name, "time_ns": e.timestamp, "attributes": {k: _plain(v) for k, v in (e.attributes or {}).items()}}
                for e in span.events],
    )


class SpanSink(Protocol):
    def write_spans(self, records: Sequence[SpanRecord]) -> None: ...


class StoreSpanProcessor(SpanProcessor):
    """Stamps rollout context on span start; on end, queues rollout spans for a writer thread.

    A thread keeps SQLite writes off the agent's path; `force_flush` waits until all queued spans are written,
    which the runtime calls before it reads a phase's spans back.

    Ending a span only appends it to a deque: no lock, no wake-up. Waking the writer for every span cost the
    agent's thread about a millisecond per call (the writer took the GIL right away and kept it while it wrote).
    The writer instead wakes every `interval` seconds, or at once on a flush, and writes what has gathered in one
    transaction.
    """

    def __init__(self, sink: SpanSink, *, max_batch: int = 512, interval: float = 0.05):
        self._sink = sink
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
        ctx = _rollout.get()
        if ctx is None:
            return
        span.set_attribute(ROLLOUT_ID, ctx.rollout_id)
        span.set_attribute(ATTEMPT, ctx.attempt)
        comp = _component.get()
        if comp is not None:
            span.set_attribute(COMPONENT, comp)

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


# ------------------------------------------------------------------------------------ token ids from the server

def _extra(obj: Any, name: str) -> Any:
    """A field the OpenAI models don't declare but keep (vLLM's extras), from a model or a dict."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(name)
    return value


def _choice_logprobs(choice: Any) -> list[float] | None:
    lp = _extra(choice, "logprobs")
    content = _extra(lp, "content") if lp is not None else None
    if not content:
        return None
    return [float(_extra(t, "logprob")) for t in content]


def _set_ids(span: Any, prompt_ids: Any, completion_ids: Any, logprobs: list[float] | None) -> None:
    if not span.is_recording():
        return
    if prompt_ids is not None:
        span.set_attribute(PROMPT_IDS, [int(t) for t in prompt_ids])
    if completion_ids is not None:
        span.set_attribute(COMPLETION_IDS, [int(t) for t in completion_ids])
    if logprobs is not None and completion_ids is not None and len(logprobs) == len(completion_ids):
        span.set_attribute(COMPLETION_LOGPROBS, logprobs)


def _record_response(span: Any, response: Any) -> None:
    choices = _extra(response, "choices") or []
    first = next((c for c in choices if (_extra(c, "index") or 0) == 0), choices[0] if choices else None)
    _set_ids(span, _extra(response, "prompt_token_ids"), _extra(first, "token_ids"), _choice_logprobs(first))


class _StreamIds:
    """Accumulates token ids and log-probs from stream chunks (choice 0)."""

    def __init__(self, span: Any):
        self.span = span
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.have_logprobs = True
        self.saw_ids = False
        self.done = False

    def add(self, chunk: Any) -> None:
        if self.prompt_ids is None and _extra(chunk, "prompt_token_ids") is not None:
            self.prompt_ids = list(_extra(chunk, "prompt_token_ids"))
        for choice in _extra(chunk, "choices") or []:
            if (_extra(choice, "index") or 0) != 0:
                continue
            ids = _extra(choice, "token_ids")
            if ids:
                self.saw_ids = True
                self.ids.extend(ids)
                lps = _choice_logprobs(choice)
                if lps is None or len(lps) != len(ids):
                    self.have_logprobs = False
                else:
                    self.logprobs.extend(lps)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        if self.saw_ids or self.prompt_ids is not None:
            _set_ids(self.span, self.prompt_ids, self.ids if self.saw_ids else None,
                     self.logprobs if self.have_logprobs and self.saw_ids else None)


def _wrap_stream(stream: Any, span: Any) -> Any:
    from wrapt import ObjectProxy

    acc = _StreamIds(span)

    # An ObjectProxy keeps `isinstance(x, openai.Stream)` true, which the instrumentor relies on.
    class IdStream(ObjectProxy):
        def __iter__(self):
            return self

        def __next__(self):
            try:
                chunk = self.__wrapped__.__next__()
            except StopIteration:
                acc.finish()
                raise
            acc.add(chunk)
            return chunk

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                chunk = await self.__wrapped__.__anext__()
            except StopAsyncIteration:
                acc.finish()
                raise
            acc.add(chunk)
            return chunk

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            acc.finish()
            return self.__wrapped__.__exit__(*exc)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            acc.finish()
            return await self.__wrapped__.__aexit__(*exc)

        def close(self):
            acc.finish()
            return self.__wrapped__.close()

    return IdStream(stream)


def _is_stream(obj: Any) -> bool:
    import openai

    return isinstance(obj, (openai.Stream, openai.AsyncStream))


def _prepare_request(instance: Any, kwargs: dict) -> dict:
    """Ask registered endpoints (vLLM) for token ids and log-probs; leaves other providers' calls untouched."""
    base = str(getattr(getattr(instance, "_client", None), "base_url", "") or "").rstrip("/")
    if not any(base.startswith(u) for u in _state.token_id_endpoints):
        return kwargs
    kwargs = dict(kwargs)
    extra_body = dict(kwargs.get("extra_body") or {})
    extra_body.setdefault("return_token_ids", True)
    kwargs["extra_body"] = extra_body
    if kwargs.get("logprobs") in (None, False) and not kwargs.get("top_logprobs"):
        kwargs["logprobs"] = True
    return kwargs


def _parsed(response: Any) -> Any:
    # `with_raw_response` calls hand back an APIResponse; parse() caches, so the caller's own parse() is free.
    from openai._legacy_response import LegacyAPIResponse

    return response.parse() if isinstance(response, LegacyAPIResponse) else response


def _sync_ids_wrapper(wrapped, instance, args, kwargs):
    span = trace.get_current_span()  # the instrumentor's span: it wraps us and makes its span current
    response = wrapped(*args, **_prepare_request(instance, kwargs))
    if _is_stream(response):
        return _wrap_stream(response, span)
    _record_response(span, _parsed(response))
    return response


async def _async_ids_wrapper(wrapped, instance, args, kwargs):
    span = trace.get_current_span()
    response = await wrapped(*args, **_prepare_request(instance, kwargs))
    if _is_stream(response):
        return _wrap_stream(response, span)
    _record_response(span, _parsed(response))
    return response


# ------------------------------------------------------------------------------------------------ installation



def request_token_ids_from(base_url: str) -> None:
    """Make OpenAI-client calls to this server ask for token ids (`return_token_ids`, vLLM's flag)."""
    _state.token_id_endpoints.add(base_url.rstrip("/"))


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
            _state.provider = TracerProvider()
            # A provider keeps its processors for life: route through one whose target can be swapped.
            _state.provider.add_span_processor(_state.forward)
            _instrument(_state.provider)
            _adopt_global(_state.provider)
        _state.forward.target = processor
        _state.processor = processor
        return processor


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
    token_id_endpoints: set[str] = field(default_factory=set)


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
        wrap_function_wrapper(mod, name, _sync_ids_wrapper)
    for name in ("AsyncCompletions.create", "AsyncCompletions.parse"):
        wrap_function_wrapper(mod, name, _async_ids_wrapper)
    # No W3C traceparent header on the agent's requests: the spans stay in our store, no server continues the
    # trace, and injecting it costs every call.
    OpenAIInstrumentor(enable_trace_context_propagation=False).instrument(tracer_provider=provider)


def describe(record: SpanRecord) -> str:
    """One line for `lightning traces`."""
    a = record.attributes
    if record.name == REWARD_SPAN:
        return f"reward {a.get(REWARD_NAME)}={a.get(REWARD_VALUE)}"
    text = _output_text(a)
    text = text if len(text) < 60 else text[:57] + "..."
    n_prompt, n_out = len(a.get(PROMPT_IDS) or []), len(a.get(COMPLETION_IDS) or [])
    return f"{record.name} [{record.component or '-'}] {n_prompt}->{n_out} tokens {record.status} {json.dumps(text)}"


def _output_text(attrs: dict[str, Any]) -> str:
    """The completion text as the instrumentor recorded it (current `gen_ai.output.messages` JSON or legacy)."""
    raw = attrs.get("gen_ai.output.messages")
    if raw:
        try:
            parts = json.loads(raw)[0].get("parts", [])
            return "".join(str(p.get("content", "")) for p in parts)
        except (ValueError, IndexError, AttributeError, TypeError):
            return str(raw)
    return str(attrs.get("gen_ai.completion.0.content", ""))
