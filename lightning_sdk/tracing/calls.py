"""OpenAI chat calls inside a rollout: made on the agent's thread, traced on the span writer thread.

Even with its attribute work deferred, the instrumentor's wrapper cost the agent's thread tens of microseconds
per call: some 200 Python calls (its span, context attach and detach, its request and response hooks), each run
once per LLM call with cold caches. For a plain (not streamed) call inside a rollout, the recorders below, the
outermost wrappers of `Completions.create` / `parse`, make the call beneath the instrumentor and keep what it
saw (`RecordedCall`: the context, the request, the response or the error, the times). The span writer thread
then replays the call through the instrumentor's wrapper (`RecordedCall.replay`) in a copy of the agent's
context: the token-id wrapper beneath it hands back the recorded response instead of calling the server, its
span gets the recorded start and end times, its clock the recorded ones (`ReplayClock`, for its duration
metrics). The span, its attributes, its status and its metrics are the instrumentor's, as if it had traced the
call live.

Streams (the agent reads their chunks through the instrumentor's stream wrapper), calls outside a rollout and
calls with instrumentation suppressed go through the instrumentor live. A failed call is replayed at once on
the agent's thread: the exception object is the agent's, and is raised on no other thread.
"""

from __future__ import annotations

import contextvars
import time
from time import time_ns
from typing import Any, Callable

from opentelemetry import context as context_api

from lightning_sdk.tracing import token_ids
from lightning_sdk.tracing.context import current_rollout
from lightning_sdk.tracing.deferred import Frozen, replaying, snapshot

RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"  # openai's `with_raw_response`: such calls go live

Submit = Callable[["RecordedCall"], None]
# What the instrumentor reads, set when a recorder is made (its modules take ~20 ms to import, which
# `import lightning_sdk` should not pay): the context keys that turn it off, and whether it emits events (which
# read the response object's attributes) rather than span attributes.
_suppress_keys: tuple[str, ...] = ()
_emits_events: Callable[[], bool] = bool


def _load_instrumentor() -> None:
    global _suppress_keys, _emits_events
    from opentelemetry.instrumentation.openai.shared.chat_wrappers import should_emit_events
    from opentelemetry.instrumentation.utils import _SUPPRESS_INSTRUMENTATION_KEY
    from opentelemetry.semconv_ai import SUPPRESS_LANGUAGE_MODEL_INSTRUMENTATION_KEY

    _suppress_keys = (_SUPPRESS_INSTRUMENTATION_KEY, SUPPRESS_LANGUAGE_MODEL_INSTRUMENTATION_KEY)
    _emits_events = should_emit_events


class RecordedCall:
    __slots__ = ("instrumented", "context", "kwargs", "start_ns", "end_ns", "response", "error", "ids", "is_async",
                 "_clock")

    def __init__(self, instrumented: Callable, kwargs: dict, is_async: bool):
        self.instrumented = instrumented  # the instrumentor's wrapper, bound to the resource: what replay calls
        self.context = contextvars.copy_context()  # the OpenTelemetry context, rollout and component
        self.kwargs = snapshot(kwargs)
        self.is_async = is_async
        self.response: Any = None
        self.error: BaseException | None = None
        self.ids: tuple | None = None  # prompt ids, choice 0's ids and sampled log-probs
        self._clock = 0
        self.start_ns = time_ns()
        self.end_ns = 0

    def replay(self) -> None:
        """Run the instrumentor's wrapper on this call (the span writer thread; the agent's thread for an error)."""
        self.context.run(self._replay)

    def _replay(self) -> None:
        token = replaying.set(self)
        try:
            out = self.instrumented(**self.kwargs)
            if self.is_async:  # nothing in it awaits: the recorded outcome is handed back at once
                try:
                    out.send(None)
                except StopIteration:
                    pass
                else:
                    out.close()
                    raise RuntimeError("the instrumentor awaited I/O while replaying a recorded call")
        except Exception as e:
            if e is not self.error:
                raise
        finally:
            replaying.reset(token)

    def clock(self) -> float:
        """The instrumentor's `time.time()` while replaying: the call's start, then its end."""
        self._clock += 1
        return (self.start_ns if self._clock == 1 else self.end_ns) / 1e9


class ReplayClock:
    """Stands in for the `time` module in the instrumentor's chat wrappers: the recorded call's clock while it is
    replayed, the real one otherwise."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        call = replaying.get()
        return time.time() if call is None else call.clock()


def _recordable(args: tuple, kwargs: dict) -> bool:
    if args or kwargs.get("stream") or replaying.get() is not None or current_rollout() is None:
        return False
    for key in _suppress_keys:
        if context_api.get_value(key):
            return False
    headers = kwargs.get("extra_headers")
    return not (headers and RAW_RESPONSE_HEADER in headers)


def _finish(call: RecordedCall, response: Any, added_logprobs: bool, submit: Submit) -> None:
    call.end_ns = time_ns()
    call.ids = token_ids.response_ids(response, strip_logprobs=added_logprobs)
    # Log-probs the agent asked for are objects per token: kept as JSON text, they cost the GC nothing.
    frozen = token_ids.holds_logprobs(response) and not _emits_events()
    call.response = Frozen(response) if frozen else response
    submit(call)


def _fail(call: RecordedCall, error: BaseException) -> None:
    call.end_ns = time_ns()
    call.error = error
    traceback = error.__traceback__
    call.replay()  # re-raises `error` through the instrumentor, which adds frames to its traceback: put it back
    error.__traceback__ = traceback


def sync_recorder(original: Callable, submit: Submit) -> Callable:
    """The outermost wrapper of a sync method whose unwrapped function is `original`."""
    _load_instrumentor()

    def recorder(wrapped, instance, args, kwargs):
        if not _recordable(args, kwargs):
            return wrapped(*args, **kwargs)
        call = RecordedCall(wrapped, kwargs, is_async=False)
        request, added_logprobs = token_ids.prepare_request(instance, kwargs)
        try:
            response = original(instance, **request)
        except Exception as e:
            _fail(call, e)
            raise
        _finish(call, response, added_logprobs, submit)
        return response

    return recorder


def async_recorder(original: Callable, submit: Submit) -> Callable:
    """The outermost wrapper of an async method whose unwrapped function is `original`."""
    _load_instrumentor()

    async def recorder(wrapped, instance, args, kwargs):
        if not _recordable(args, kwargs):
            return await wrapped(*args, **kwargs)
        call = RecordedCall(wrapped, kwargs, is_async=True)
        request, added_logprobs = token_ids.prepare_request(instance, kwargs)
        try:
            response = await original(instance, **request)
        except Exception as e:
            _fail(call, e)
            raise
        _finish(call, response, added_logprobs, submit)
        return response

    return recorder
