"""Spans for OpenAI Responses API calls (`client.responses.create` / `.parse`, sync and async, plain, streamed and
raw), carrying the exact token ids the server returned, so that such a call trains exactly as a chat call does.

opentelemetry-instrumentation-openai 0.62 traces these calls in ways training cannot use: a plain call's span is
started only after the call returned (it is not current during the call), a response whose status is not
"completed" gets no span at all (a reply cut by max_output_tokens, a sample like any other, would be lost), its
`retrieve` wrapper emits a second LLM-call span (without token ids) for a response fetched again, and every
response is kept in a module-level dict for the life of the process. `instrument` replaces its Responses wrappers
with these: a span started before the call and current during it, named and attributed by the instrumentor's own
helpers (run on the span writer thread, see `deferred`), ERROR on an exception, a `failed` response or an `error`
stream event, and the Response's `prompt_token_ids`, `output_token_ids` and `output_logprobs` (which
`gateway/responses.py` adds) as the `lightning.llm.*` token-id attributes. A streamed call's span ends at the
stream's final event (`response.completed` / `.incomplete` / `.failed`), which carries the whole Response; a
stream closed before it is an ERROR span (a failed call, never a transition).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from wrapt import ObjectProxy

from lightning_sdk.tracing import token_ids
from lightning_sdk.tracing.deferred import AttributeTarget, defer, in_rollout, snapshot

_log = logging.getLogger("lightning_sdk")
SPAN_NAME = "openai.response"  # the instrumentor's name for these spans
_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_INSTRUMENTOR_METHODS = ("create", "retrieve", "parse", "cancel")
_TRACED_METHODS = ("create", "parse")


def instrument(provider: Any) -> None:
    """Replace the OpenAI instrumentor's Responses wrappers with ours (call after `OpenAIInstrumentor().instrument`).

    `retrieve` and `cancel` are left untraced: neither samples anything.
    """
    import openai.resources.responses as module
    from opentelemetry.instrumentation.openai.version import __version__
    from opentelemetry.instrumentation.utils import unwrap
    from wrapt import wrap_function_wrapper

    for cls in (module.Responses, module.AsyncResponses):
        for method in _INSTRUMENTOR_METHODS:
            unwrap(cls, method)  # with the class itself: the instrumentor's own uninstrument misses these
    # The instrumentor's scope, so exported spans read as its other spans do.
    tracer = trace.get_tracer("opentelemetry.instrumentation.openai.v1", __version__, provider)
    for method in _TRACED_METHODS:
        wrap_function_wrapper(module.Responses, method, _sync_wrapper(tracer))
        wrap_function_wrapper(module.AsyncResponses, method, _async_wrapper(tracer))


def _sync_wrapper(tracer: trace.Tracer):
    def wrapper(wrapped, instance, args, kwargs):
        if _suppressed():
            return wrapped(*args, **kwargs)
        kwargs = _ask_token_ids(instance, kwargs)
        call = _Call(tracer, instance, kwargs)
        with trace.use_span(call.span, end_on_exit=False):
            try:
                response = wrapped(*args, **kwargs)
            except BaseException as e:
                call.fail(e)
                raise
        if call.streamed and _is_raw(response):
            return _RawStream(response, call)  # its parse() hands back the event stream
        if _is_stream(response):
            return _EventStream(response, call)
        call.finish(response.parse() if _is_raw(response) else response)  # a raw response caches what it parsed
        return response

    return wrapper


def _async_wrapper(tracer: trace.Tracer):
    async def wrapper(wrapped, instance, args, kwargs):
        if _suppressed():
            return await wrapped(*args, **kwargs)
        kwargs = _ask_token_ids(instance, kwargs)
        call = _Call(tracer, instance, kwargs)
        with trace.use_span(call.span, end_on_exit=False):
            try:
                response = await wrapped(*args, **kwargs)
            except BaseException as e:
                call.fail(e)
                raise
        if call.streamed and _is_raw(response):
            return _RawStream(response, call)
        if _is_stream(response):
            return _EventStream(response, call)
        if _is_raw(response):
            parsed = response.parse()
            call.finish(await parsed if inspect.isawaitable(parsed) else parsed)
        else:
            call.finish(response)
        return response

    return wrapper


def _suppressed() -> bool:
    from opentelemetry.instrumentation.utils import _SUPPRESS_INSTRUMENTATION_KEY

    return bool(context_api.get_value(_SUPPRESS_INSTRUMENTATION_KEY))


def _ask_token_ids(instance: Any, kwargs: dict) -> dict:
    """Ask registered endpoints for token ids (`return_token_ids`), as the chat path does; the built-in gateway adds
    them anyway, and other providers' calls are left untouched."""
    base = str(getattr(getattr(instance, "_client", None), "base_url", "") or "").rstrip("/")
    if not any(base.startswith(u) for u in token_ids._endpoints):
        return kwargs
    kwargs = dict(kwargs)
    kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), "return_token_ids": True}
    return kwargs


def _is_stream(obj: Any) -> bool:
    import openai

    return isinstance(obj, (openai.Stream, openai.AsyncStream))


def _is_raw(obj: Any) -> bool:
    from openai._legacy_response import LegacyAPIResponse
    from openai._response import APIResponse, AsyncAPIResponse

    return isinstance(obj, (LegacyAPIResponse, APIResponse, AsyncAPIResponse))


class _Call:
    """One traced call: its span, started before the request, and what the writer thread needs to attribute it."""

    def __init__(self, tracer: trace.Tracer, instance: Any, kwargs: dict):
        self.span = tracer.start_span(SPAN_NAME, kind=SpanKind.CLIENT, attributes={"gen_ai.operation.name": "chat"})
        self.instance = instance
        self.streamed = kwargs.get("stream") is True
        # Outside a rollout the span reaches no store: nothing is kept for it, no attributes are built.
        self.request = _request(kwargs) if in_rollout(self.span) else None
        self.done = False

    def fail(self, error: BaseException) -> None:
        if self.done:
            return
        self.span.set_attribute("error.type", type(error).__name__)
        self.span.record_exception(error)
        self._end(None, f"{type(error).__name__}: {error}")

    def finish(self, response: Any) -> None:
        """The call's Response (a plain call's, or a stream's final event's)."""
        if self.done:
            return
        error = None
        if getattr(response, "status", None) == "failed":
            self.span.set_attribute("error.type", "response.failed")
            error = f"the response failed: {getattr(response, 'error', None)}"
        self._end(response, error)

    def event(self, event: Any) -> None:
        kind = getattr(event, "type", None)
        if kind in _FINAL_EVENTS:
            self.finish(getattr(event, "response", None))
        elif kind == "error":
            self.span.set_attribute("error.type", str(getattr(event, "code", None) or "error"))
            self._end(None, f"error event: {getattr(event, 'message', '')}")

    def abandon(self) -> None:
        """The stream ended or was closed without its final event: no Response, a failed call."""
        if not self.done:
            self._end(None, "the stream ended before its final event (response.completed / .incomplete)")

    def _end(self, response: Any, error: str | None) -> None:
        self.done = True
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        if self.request is not None:
            request, instance = self.request, self.instance
            defer(self.span, lambda target: _attributes(target, request, instance, response))
        self.span.end()


def _request(kwargs: dict) -> dict:
    """The request as the call saw it, without openai's omit/NOT_GIVEN sentinels: agents reuse their input list."""
    from opentelemetry.instrumentation.openai.v1.responses_wrappers import _sanitize_sentinel_values

    return snapshot(_sanitize_sentinel_values(kwargs), "input")


def _attributes(target: AttributeTarget, request: dict, instance: Any, response: Any) -> None:
    """The span's attributes, by the instrumentor's helpers, and the token ids (writer thread)."""
    from opentelemetry.instrumentation.openai.shared import _set_request_attributes
    from opentelemetry.instrumentation.openai.v1.responses_wrappers import (
        prepare_kwargs_for_shared_attributes,
        set_data_attributes,
    )

    try:
        _set_request_attributes(target, prepare_kwargs_for_shared_attributes(request), instance)
        set_data_attributes(_traced_data(request, response), target)
    except Exception as e:  # a span without its gen_ai attributes beats a lost batch of spans
        _log.warning("Responses span attributes skipped: %s: %s", type(e).__name__, e)
    if response is not None:
        extra = token_ids._extra
        token_ids._set_ids(target, extra(response, "prompt_token_ids"), extra(response, "output_token_ids"),
                           extra(response, "output_logprobs"))


def _traced_data(request: dict, response: Any) -> Any:
    """The instrumentor's record of a call (what `set_data_attributes` reads), from the request and its Response."""
    from opentelemetry.instrumentation.openai.v1.responses_wrappers import (
        TracedData,
        get_tools_from_kwargs,
        process_input,
    )

    reasoning = request.get("reasoning") or {}
    output = list(getattr(response, "output", None) or [])
    incomplete = getattr(response, "incomplete_details", None)
    return TracedData(
        start_time=0,  # unused: the span has its own
        response_id=getattr(response, "id", None) or "",
        input=process_input(request.get("input")),
        instructions=request.get("instructions"),
        tools=get_tools_from_kwargs(request),
        # Function calls may come without an item id: key them by call id, or position.
        output_blocks={(getattr(b, "id", None) or getattr(b, "call_id", None) or str(i)): b
                       for i, b in enumerate(output)},
        usage=getattr(response, "usage", None),
        output_text=getattr(response, "output_text", None) if response is not None else None,
        request_model=request.get("model"),
        response_model=getattr(response, "model", None),
        request_reasoning_summary=reasoning.get("summary") if isinstance(reasoning, dict) else None,
        request_reasoning_effort=reasoning.get("effort") if isinstance(reasoning, dict) else None,
        request_service_tier=request.get("service_tier"),
        response_service_tier=getattr(response, "service_tier", None),
        response_status=getattr(response, "status", None),
        incomplete_reason=getattr(incomplete, "reason", None),
    )


class _EventStream(ObjectProxy):
    """A Responses event stream that ends its call's span at the final event (or on close / an exception)."""

    def __init__(self, stream: Any, call: _Call):
        super().__init__(stream)
        self._self_call = call

    def __iter__(self):
        return self

    def __next__(self):
        try:
            event = self.__wrapped__.__next__()
        except StopIteration:
            self._self_call.abandon()
            raise
        except BaseException as e:
            self._self_call.fail(e)
            raise
        self._self_call.event(event)
        return event

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            event = await self.__wrapped__.__anext__()
        except StopAsyncIteration:
            self._self_call.abandon()
            raise
        except BaseException as e:
            self._self_call.fail(e)
            raise
        self._self_call.event(event)
        return event

    def __enter__(self):
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, *exc):
        self._self_call.abandon()
        return self.__wrapped__.__exit__(*exc)

    async def __aenter__(self):
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, *exc):
        self._self_call.abandon()
        return await self.__wrapped__.__aexit__(*exc)

    def close(self):
        self._self_call.abandon()
        return self.__wrapped__.close()

    def __del__(self):
        call = getattr(self, "_self_call", None)
        if call is not None:
            call.abandon()


class _RawStream(ObjectProxy):
    """A raw response (`with_raw_response` / `with_streaming_response`) to a streamed call: its `parse()` returns
    the event stream, traced; closing it unparsed or unfinished ends the span as a failed call."""

    def __init__(self, response: Any, call: _Call):
        super().__init__(response)
        self._self_call = call
        self._self_stream = None

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        parsed = self.__wrapped__.parse(*args, **kwargs)
        if inspect.isawaitable(parsed):  # AsyncAPIResponse
            return self._parse_async(parsed)
        return self._traced(parsed)

    async def _parse_async(self, parsed: Any) -> Any:
        return self._traced(await parsed)

    def _traced(self, parsed: Any) -> Any:
        if not _is_stream(parsed):
            return parsed
        if self._self_stream is None:
            self._self_stream = _EventStream(parsed, self._self_call)
        return self._self_stream

    def close(self):
        self._self_call.abandon()
        return self.__wrapped__.close()
