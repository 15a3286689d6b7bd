"""What stands between the network and a server's routes: the API-key check, the body limit, uvicorn's
connection limits, and what every request body's model checks (`Lenient`: no lone surrogates, unknown fields
ignored).

Shared by the inference server (`engine/app.py`, in its own process) and the routes the runtime's process serves
(`gateway/proxy.py`, `gateway/responses.py`); it imports neither torch nor the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import resource
import time
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lightning_sdk.console import printable

log = logging.getLogger("lightning_sdk.servers")

OPEN_PATHS = frozenset({"/health"})  # liveness probes, as vLLM leaves it open; every other route needs the key
DEFAULT_HEADER_TIMEOUT = 15.0  # seconds a client has to send a request's complete headers
DEFAULT_MAX_CONNECTIONS = 1000  # open connections at once; beyond them, 503 and close
_FD_RESERVE = 128  # descriptors kept for the model files, the log, torch's threads
INT64 = 2**63  # vLLM's seed range is int64's, and torch.Generator takes no more
MAX_BODY_BYTES = 16 * 2**20  # far above any request that fits a context window (or one OTLP export)
PARSE_INLINE_BYTES = 64 * 2**10  # a body above this is parsed in a thread, so a big one never stalls the loop
_SURROGATE = re.compile("[\ud800-\udfff]")


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape. A lone surrogate from the request (echoed in `message`) cannot be UTF-8 encoded:
    escape it, so that the error itself never fails."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    types = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": types.get(status, "APIError"), "param": param, "code": status}}


T = TypeVar("T")


async def parse_off_loop(raw: bytes, parse: Callable[[bytes], T]) -> T:
    """`parse(raw)`: on the event loop for a small body, in a thread for a big one (megabytes of JSON)."""
    return parse(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(parse, raw)


def surrogate_at(value: Any) -> str | None:
    """Where in a decoded JSON value a lone surrogate is (JSON allows "\\ud800", UTF-8 cannot hold it)."""
    if isinstance(value, str):
        return "" if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and _SURROGATE.search(k):
            return f".{k.encode('utf-8', 'backslashreplace').decode()}"
        if (at := surrogate_at(v)) is not None:
            return f".{k}{at}"
    return None


def text_size(value: Any) -> int:
    """Characters in all the strings (keys included) of a decoded JSON value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + text_size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(text_size(v) for v in value)
    return 0


class Lenient(BaseModel):
    """A request body's model: unknown fields are ignored, as OpenAI and vLLM do; lone surrogates are refused."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, v: Any, info: ValidationInfo) -> Any:
        # A lone surrogate would fail later, wherever the text is encoded (tokenizer, file path, log, response).
        if (at := surrogate_at(v)) is not None:
            raise ValueError(f"{info.field_name}{at} holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                             f"valid Unicode text")
        return v


class GatewayError(Exception):
    """A request the gateway (or a route it serves) answers with an OpenAI-shaped error (`error_body`)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def _send_json(send: Any, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class PerSourceLog:
    """Lines about requests summarised as a reverse proxy does, so that a flood cannot grow the log without bound:
    the first such request from a source in a minute is logged at once (`first`, formatted with the source and the
    request's own words), the rest are counted and logged as one line per source when the minute ends (`more`,
    formatted with the count and the source). At most `max_sources` sources are told apart per minute; more are
    counted together. Whatever a request sent is logged escaped (`printable`): it cannot forge a line."""

    def __init__(self, first: str, more: str, *, window: float = 60.0, max_sources: int = 64,
                 clock: Callable[[], float] = time.monotonic):
        self.first_line, self.more_line = first, more
        self.window, self.max_sources, self.clock = window, max_sources, clock
        self.counts: dict[str, int] = {}
        self.until: float | None = None  # the end of the current minute; None while nothing was noted

    def note(self, source: str, **words: Any) -> bool:
        """Count one request; True when it opened a new minute (the caller arranges a `flush` at its end)."""
        now = self.clock()
        if self.until is not None and now >= self.until:
            self.flush()
        opened = self.until is None
        if opened:
            self.until = now + self.window
        if source not in self.counts and len(self.counts) >= self.max_sources:
            source = "other sources"
        self.counts[source] = self.counts.get(source, 0) + 1
        if self.counts[source] == 1:
            log.warning(self.first_line.format(source=source, **{k: printable(v) for k, v in words.items()}))
        return opened

    def flush(self) -> None:
        """Log the minute's counts (requests after the first, per source) and start afresh."""
        for source, n in self.counts.items():
            if n > 1:
                log.warning(self.more_line.format(n=n - 1, source=source, window=self.window))
        self.counts, self.until = {}, None

    def flush_later(self) -> None:
        """Arrange the minute's `flush` at its end, on the running event loop (after a `note` that opened one),
        even if nothing more is noted."""
        until = self.until
        asyncio.get_running_loop().call_later(self.window, lambda: self.until == until and self.flush())


class RefusedRequests(PerSourceLog):
    """401s summarised per source per minute."""

    def __init__(self, **kw: Any):
        super().__init__("{method} {path!r} from {source} -> 401 (missing or wrong API key); further refusals "
                         "from it are counted, one line a minute",
                         "{n} more request(s) from {source} refused with 401 in the last {window:.0f}s", **kw)

    def note(self, source: str, method: str, path: str) -> bool:  # type: ignore[override]
        return super().note(source, method=method, path=path)


class KeyCheck:
    """ASGI middleware: every route but /health needs `Authorization: Bearer KEY`, checked before the body is
    read or parsed, so a caller without the key gets 401 and learns nothing else (not /stats, not /docs, not
    which routes exist). `route_keys` (path prefix -> key) gives some routes a key of their own, which opens
    those routes only (the remote runtime's work routes: the agents' key cannot claim work). Refusals are logged
    summarised (`RefusedRequests`)."""

    def __init__(self, app: Any, api_key: str, route_keys: dict[str, str] | None = None):
        if not api_key or not all((route_keys or {}).values()):
            raise ValueError("api_key must not be empty")
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.route_keys = sorted(((prefix, f"Bearer {key}".encode()) for prefix, key in (route_keys or {}).items()),
                                 key=lambda pk: -len(pk[0]))
        self.refused = RefusedRequests()

    def _expected(self, path: str) -> bytes:
        for prefix, key in self.route_keys:
            if path == prefix or prefix.endswith("/") and path.startswith(prefix):
                return key
        return self.expected

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(header, self._expected(scope["path"])):
                source = (scope.get("client") or ("unknown",))[0]
                if self.refused.note(str(source), str(scope.get("method")), scope["path"]):
                    self.refused.flush_later()
                return await _send_json(send, 401, error_body(
                    401, "Unauthorized: missing or wrong API key (Authorization: Bearer ...)"))
        await self.app(scope, receive, send)


def connection_cap(wanted: int) -> int:
    """`wanted` connections, lowered to what the process's descriptor limit leaves room for. The soft limit is
    first raised to the hard one (as vLLM does), so that the cap, not EMFILE, is what a flood meets: an accept
    that fails with "Too many open files" is logged again and again by asyncio."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = min(hard, 1 << 16) if hard != resource.RLIM_INFINITY else 1 << 16
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
            soft = max(soft, target)
        except (ValueError, OSError):
            pass
    cap = max(1, min(wanted, soft - _FD_RESERVE))
    if cap < wanted:
        log.warning("connection cap lowered from %d to %d: the open-file limit is %d", wanted, cap, soft)
    return cap


class _Refusals:
    """Counts connections refused over the cap and logs them at most once per `every` seconds, not once each."""

    def __init__(self, every: float = 10.0):
        self.every, self.count, self.last = every, 0, float("-inf")

    def note(self, cap: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.warning("%d connection(s) refused with 503: %d open, the cap", self.count, cap)
            self.count, self.last = 0, now


def guarded_protocol(*, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol plus the two limits uvicorn lacks (pass it as `uvicorn.Config(http=...)`).
    httptools (llhttp, in C) rather than h11 (pure Python): parsing and writing a request costs the gateway's loop
    ~0.1-0.2 ms less a call (benchmarks/README.md, "The gateway's hop").

    uvicorn arms its keep-alive timer only after a response, so a connection that never completes its first
    request's headers stays open forever, and `limit_concurrency` answers 503 only once headers are complete.
    Here a request's headers must be complete within `header_timeout` seconds of the connection opening (or of
    the previous response), in total however slowly they trickle in; and a connection beyond `max_connections`
    gets a 503 and is closed at once, before it holds a descriptor any longer.
    """
    refusals = _Refusals()
    busy = json.dumps(error_body(503, f"the server has {max_connections} connections open, its limit; retry "
                                      f"later")).encode()
    busy_response = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: " + str(len(busy)).encode() + b"\r\n\r\n" + busy)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False
        # Requests whose headers were complete, and responses sent: equal while the connection waits for headers.
        _headers_in = 0
        _responses_out = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                self._refused = True
                refusals.note(max_connections)
                transport.write(busy_response)
                transport.close()
                return
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def on_headers_complete(self) -> None:
            self._headers_in += 1
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._responses_out += 1
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request on this keep-alive connection gets the same deadline

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_overdue)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            # Only a connection with no request whose headers are complete: a request being served is never cut.
            if self._headers_in == self._responses_out and not self.transport.is_closing():
                self.transport.close()

    return GuardedHttpToolsProtocol


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets an OpenAI-shaped 413 before anything parses it.

    A declared Content-Length is refused at once; a chunked body is read here up to the limit and replayed.
    """

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # The client left before its body was whole (an aborted upload): nobody is there to answer, and no
                # route is given half a body.
                log.debug("%s %s: the client left before sending its whole body", scope.get("method"),
                          scope.get("path"))
                return
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body"):
                break
        pending = iter(messages)

        async def replay() -> dict:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        log.warning("%s %s -> 413: body over %d bytes", scope.get("method"), scope.get("path"), self.limit)
        await _send_json(send, 413, error_body(413, f"the request body is larger than the server's limit of "
                                                    f"{self.limit} bytes"))
