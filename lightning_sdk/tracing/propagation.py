"""Which rollout an LLM call belongs to, told to the run's gateway with W3C `traceparent` and `baggage` headers.

Inside a rollout, every request an agent sends toward the gateway's address carries the rollout's trace context
and its component (`context.component`), injected with OpenTelemetry's public propagators into the request's
headers; the gateway makes the call's training record from that (gateway/capture.py). Requests to any other host
get nothing. The reply's `x-lightning-call-id` header is kept as the latest call the rollout has seen, so that
`emit_reward` and a failed tool are credited to the call the agent had read, not to one a clock says came before.

This wraps the public `send` of the HTTP clients Python agents use, whatever library sits above them (the OpenAI
client, LiteLLM's `client.post`, LangChain, a raw `httpx.post` or `requests.post`, aiohttp): httpx2 (which openai
3.x sends through, and for which no OpenTelemetry instrumentation exists), httpx, `requests.Session.send`, and
aiohttp through its public `trace_configs`. It makes no client spans of its own; clients built before `enable`
are covered too.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context

from lightning_sdk.tracing.context import PROPAGATOR, current_rollout

CALL_ID_HEADER = "x-lightning-call-id"  # the gateway's answer: the id of its record of the call
# A remote worker's claim secret, on its calls toward the gateway (and its results): only calls that carry it are
# recorded into the claim's rollout. Sent as a header of its own, never as baggage, which other hosts may be sent.
CLAIM_HEADER = "x-lightning-claim"

_target: tuple[str, int] | None = None  # (host, port) of the gateway
_installed = False
_lock = threading.Lock()


def enable(base_url: str) -> None:
    """Propagate rollout context on requests toward `base_url`'s host and port (the run's gateway)."""
    global _target
    parts = urlsplit(base_url)
    _target = ((parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80))
    _install()


def disable() -> None:
    global _target
    _target = None


def _toward_gateway(host: Any, port: Any, scheme: Any) -> bool:
    target = _target
    if target is None:
        return False
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if isinstance(scheme, bytes):
        scheme = scheme.decode("ascii", "replace")
    port = port or (443 if scheme == "https" else 80)
    return (str(host).lower(), int(port)) == target


def _inject(headers: Any) -> None:
    PROPAGATOR.inject(headers, context=otel_context.get_current())
    ctx = current_rollout()
    if ctx is not None and ctx.claim is not None:
        headers[CLAIM_HEADER] = ctx.claim


def _saw(headers: Any) -> None:
    ctx = current_rollout()
    call_id = headers.get(CALL_ID_HEADER) if headers is not None else None
    if ctx is not None and call_id:
        ctx.saw_call(str(call_id))


# ------------------------------------------------------------------------------------ the HTTP clients' send

def _httpx_send(wrapped, instance, args, kwargs):
    request = args[0] if args else kwargs.get("request")
    if current_rollout() is None or request is None or not _toward_gateway(request.url.host, request.url.port,
                                                                           request.url.scheme):
        return wrapped(*args, **kwargs)
    _inject(request.headers)
    response = wrapped(*args, **kwargs)
    _saw(response.headers)
    return response


async def _httpx_async_send(wrapped, instance, args, kwargs):
    request = args[0] if args else kwargs.get("request")
    if current_rollout() is None or request is None or not _toward_gateway(request.url.host, request.url.port,
                                                                           request.url.scheme):
        return await wrapped(*args, **kwargs)
    _inject(request.headers)
    response = await wrapped(*args, **kwargs)
    _saw(response.headers)
    return response


def _requests_send(wrapped, instance, args, kwargs):
    request = args[0] if args else kwargs.get("request")
    if current_rollout() is None or request is None:
        return wrapped(*args, **kwargs)
    url = urlsplit(request.url)
    if not _toward_gateway(url.hostname, url.port, url.scheme):
        return wrapped(*args, **kwargs)
    _inject(request.headers)
    response = wrapped(*args, **kwargs)
    _saw(response.headers)
    return response


async def _aiohttp_request_start(session: Any, trace_config_ctx: Any, params: Any) -> None:
    if current_rollout() is not None and _toward_gateway(params.url.host, params.url.port, params.url.scheme):
        _inject(params.headers)


async def _aiohttp_request_end(session: Any, trace_config_ctx: Any, params: Any) -> None:
    if current_rollout() is not None and _toward_gateway(params.url.host, params.url.port, params.url.scheme):
        _saw(params.response.headers)


def _aiohttp_init(wrapped, instance, args, kwargs):
    import aiohttp

    config = aiohttp.TraceConfig()
    config.on_request_start.append(_aiohttp_request_start)
    config.on_request_end.append(_aiohttp_request_end)
    kwargs["trace_configs"] = [*(kwargs.get("trace_configs") or ()), config]
    return wrapped(*args, **kwargs)


# module, class.method, wrapper: each wrapped only if its library is installed
_SENDS = (
    ("httpx2", "Client.send", _httpx_send), ("httpx2", "AsyncClient.send", _httpx_async_send),
    ("httpx", "Client.send", _httpx_send), ("httpx", "AsyncClient.send", _httpx_async_send),
    ("requests", "Session.send", _requests_send),
    ("aiohttp", "ClientSession.__init__", _aiohttp_init),
)


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        from wrapt import wrap_function_wrapper

        for module, name, wrapper in _SENDS:
            try:
                importlib.import_module(module)
            except ImportError:
                continue
            wrap_function_wrapper(module, name, wrapper)
        _installed = True
