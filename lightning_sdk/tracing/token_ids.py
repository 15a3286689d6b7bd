"""Exact token ids and log-probs from the server's response, put on the instrumentor's span. Never re-tokenized.

`opentelemetry-instrumentation-openai` records each OpenAI-client call as a span (prompt, completion, model,
usage) but not token ids. These wrappers, installed *inside* the instrumentor's wrapper (so its span is current
when they run), ask registered endpoints for token ids (`return_token_ids`, vLLM's flag, which the built-in
server honours too) and copy vLLM's `prompt_token_ids` / `choices[].token_ids` fields and the sampled tokens'
log-probs onto the span, for plain, streamed and raw-response calls.

The calling thread only keeps references to the response's id lists and the sampled log-probs as floats (or the
stream's chunks); copying them into the span's lists happens on the span writer thread (`deferred`), before the
span is stored or exported.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from lightning_sdk.tracing.deferred import AttributeTarget, Frozen, defer, in_rollout, replaying
from lightning_sdk.tracing.records import COMPLETION_IDS, COMPLETION_LOGPROBS, PROMPT_IDS

# Base URLs whose calls ask for token ids; other providers' calls are left untouched.
_endpoints: set[str] = set()
# id(client) -> (its base URL object, whether it asks): turning the URL into a string costs every call.
_asks: dict[int, tuple[Any, bool]] = {}


def request_token_ids_from(base_url: str) -> None:
    """Make OpenAI-client calls to this server ask for token ids (`return_token_ids`, vLLM's flag)."""
    _endpoints.add(base_url.rstrip("/"))
    _asks.clear()


def _asks_for_ids(instance: Any) -> bool:
    client = getattr(instance, "_client", None)
    url = getattr(client, "base_url", None)
    known = _asks.get(id(client))
    if known is not None and known[0] is url:  # the URL object is kept: a new client at the same id differs
        return known[1]
    base = str(url or "").rstrip("/")
    asks = any(base.startswith(u) for u in _endpoints)
    if len(_asks) >= 256:
        _asks.clear()
    _asks[id(client)] = (url, asks)
    return asks


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


def _set_ids(target: AttributeTarget, prompt_ids: Any, completion_ids: Any, logprobs: list[float] | None) -> None:
    # Plain lists of ints/floats built here: no need for OpenTelemetry's per-element check.
    if prompt_ids is not None:
        target.trusted[PROMPT_IDS] = [int(t) for t in prompt_ids]
    if completion_ids is not None:
        target.trusted[COMPLETION_IDS] = [int(t) for t in completion_ids]
    if logprobs is not None and completion_ids is not None and len(logprobs) == len(completion_ids):
        target.trusted[COMPLETION_LOGPROBS] = logprobs


def response_ids(response: Any, strip_logprobs: bool) -> tuple[Any, Any, list[float] | None]:
    """The prompt's ids and choice 0's ids and sampled log-probs (the id lists as the response holds them).

    With `strip_logprobs` (tracing asked for log-probs, the agent did not) the response's log-prob objects are
    dropped, so the agent gets the reply it asked for, and those objects (a few per token) do not outlive the call.
    """
    choices = _extra(response, "choices") or []
    first = next((c for c in choices if (_extra(c, "index") or 0) == 0), choices[0] if choices else None)
    ids = _extra(response, "prompt_token_ids"), _extra(first, "token_ids"), _choice_logprobs(first)
    if strip_logprobs:
        for choice in choices:
            if hasattr(choice, "logprobs"):
                choice.logprobs = None
    return ids


def holds_logprobs(response: Any) -> bool:
    """Whether a reply carries log-prob objects (a few per token): the agent asked for them."""
    choices = getattr(response, "choices", None)
    if choices is None and hasattr(response, "parse"):  # a `with_raw_response` call's APIResponse
        choices = getattr(response.parse(), "choices", None)
    return any(getattr(c, "logprobs", None) is not None for c in choices or ())


def _stream_ids(target: AttributeTarget, chunks: list[Any]) -> None:
    """Token ids and log-probs of choice 0, gathered from a stream's chunks."""
    prompt_ids: Any = None
    ids: list[int] = []
    logprobs: list[float] = []
    have_logprobs, saw_ids = True, False
    for chunk in chunks:
        if prompt_ids is None:
            prompt_ids = _extra(chunk, "prompt_token_ids")
        for choice in _extra(chunk, "choices") or []:
            if (_extra(choice, "index") or 0) != 0:
                continue
            chunk_ids = _extra(choice, "token_ids")
            if chunk_ids:
                saw_ids = True
                ids.extend(chunk_ids)
                lps = _choice_logprobs(choice)
                if lps is None or len(lps) != len(chunk_ids):
                    have_logprobs = False
                else:
                    logprobs.extend(lps)
    if saw_ids or prompt_ids is not None:
        _set_ids(target, prompt_ids, ids if saw_ids else None, logprobs if have_logprobs and saw_ids else None)


class _StreamIds:
    """Keeps a stream's chunks; the writer thread reads the ids out of them once the stream has ended."""

    def __init__(self, span: Any):
        self.span = span
        self.chunks: list[Any] = []
        self.done = False

    def add(self, chunk: Any) -> None:
        self.chunks.append(chunk)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        chunks = self.chunks
        defer(self.span, lambda target: _stream_ids(target, chunks))


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


_stream_types: tuple[type, ...] = ()


def _is_stream(obj: Any) -> bool:
    global _stream_types
    if not _stream_types:
        import openai  # not at import time: `import lightning_sdk` stays light

        _stream_types = (openai.Stream, openai.AsyncStream)
    return isinstance(obj, _stream_types)


def prepare_request(instance: Any, kwargs: dict) -> tuple[dict, bool]:
    """Ask registered endpoints (vLLM) for token ids and log-probs; leaves other providers' calls untouched.
    Returns the request and whether log-probs were added to it."""
    if not _asks_for_ids(instance):
        return kwargs, False
    kwargs = dict(kwargs)
    extra_body = dict(kwargs.get("extra_body") or {})
    extra_body.setdefault("return_token_ids", True)
    kwargs["extra_body"] = extra_body
    add_logprobs = kwargs.get("logprobs") in (None, False) and not kwargs.get("top_logprobs")
    if add_logprobs:
        kwargs["logprobs"] = True
    return kwargs, add_logprobs


def _parsed(response: Any) -> Any:
    # `with_raw_response` calls hand back an APIResponse; parse() caches, so the caller's own parse() is free.
    return response.parse() if not hasattr(response, "choices") and hasattr(response, "parse") else response


def _keep_ids(span: Any, response: Any, added_logprobs: bool) -> None:
    ids = response_ids(_parsed(response), strip_logprobs=added_logprobs)
    defer(span, lambda target: _set_ids(target, *ids))


def _replayed(span: Any, call: Any) -> Any:
    """A recorded call's outcome, handed to the instrumentor replaying it (`calls`), its ids to its span."""
    if call.error is not None:
        raise call.error
    if call.ids is not None:
        ids = call.ids
        defer(span, lambda target: _set_ids(target, *ids))
    return call.response.data() if isinstance(call.response, Frozen) else call.response


# Calls outside a rollout are left as they are: their spans reach no store.
def sync_wrapper(wrapped, instance, args, kwargs):
    span = trace.get_current_span()  # the instrumentor's span: it wraps us and makes its span current
    if (call := replaying.get()) is not None:
        return _replayed(span, call)
    if not in_rollout(span):
        return wrapped(*args, **kwargs)
    request, added_logprobs = prepare_request(instance, kwargs)
    response = wrapped(*args, **request)
    if _is_stream(response):
        return _wrap_stream(response, span)
    _keep_ids(span, response, added_logprobs)
    return response


async def async_wrapper(wrapped, instance, args, kwargs):
    span = trace.get_current_span()
    if (call := replaying.get()) is not None:
        return _replayed(span, call)
    if not in_rollout(span):
        return await wrapped(*args, **kwargs)
    request, added_logprobs = prepare_request(instance, kwargs)
    response = await wrapped(*args, **request)
    if _is_stream(response):
        return _wrap_stream(response, span)
    _keep_ids(span, response, added_logprobs)
    return response
