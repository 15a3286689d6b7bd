"""The gateway's client to its backends: HTTP/1.1 POSTs over kept-alive connections, replies parsed by httptools
(llhttp, the parser uvicorn serves the gateway with).

Every call through the gateway pays this client on the gateway's event loop. A general-purpose client does much
that a backend exchange never needs (cookies, redirects, proxies, a timer rearmed per chunk, request and response
objects of many layers) and costs the loop several times this one's CPU per request (benchmarks/README.md, "The
gateway's hop"). What is here is what the backends (the built-in server, vLLM, a Ray server actor) need: a POST with
its body in one write, a reply whose end is its Content-Length, its last chunk or the connection's close, http or
https, connections kept alive and reused, a cap on how many are open, and timeouts.

`Upstream` reads like the `httpx.Response` a client opens with `stream=True`, so the routes read a reply one way.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import socket
import ssl
from typing import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools
from starlette.datastructures import Headers


class BackendError(Exception):
    """A failed exchange with a backend: the connection broken, a reply cut off or malformed, a timeout."""


class Refused(BackendError):
    """No connection could be made: nothing reached the backend, so another replica may take the request."""


_HIGH_WATER = 1 << 20  # bytes of a reply held unread before the socket stops being read (a slow reader)


@functools.lru_cache(maxsize=256)
def _target(url: str) -> tuple[tuple[str, int, bool], bytes]:
    """((host, port, tls), the request's first bytes up to its headers) of an http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a backend's URL must be http(s)://host[:port]/path, not {url[:200]!r}")
    tls = parts.scheme == "https"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]
    return (parts.hostname, parts.port or (443 if tls else 80), tls), \
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n".encode("ascii")


def _header_lines(headers: Mapping[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        line = f"{name}: {value}\r\n".encode("latin-1")
        if line.count(b"\r") != 1 or line.count(b"\n") != 1:
            raise ValueError(f"header {name[:100]!r}: a line break in a header would split the request")
        lines.append(line)
    return b"".join(lines)


class Upstream:
    """A backend's reply, its status and headers received, its body still to be read (once: `aread` or
    `aiter_lines`); `aclose` gives the connection back, or drops it when the body was not read to its end."""

    def __init__(self, connection: "_Connection", status: int, headers: Headers):
        self.status_code = status
        self.headers: Mapping[str, str] = headers  # case-insensitive, as HTTP headers are
        self._connection = connection
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._ended = False
        self._error: BackendError | None = None
        self._wake: asyncio.Future | None = None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self._body()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines, without their line ends, however long a line is (a streamed chunk carrying a long
        prompt's token ids is one long line)."""
        pending = bytearray()
        async for data in self._body():
            pending += data
            if b"\n" not in data:  # a long line's middle: kept, not searched again
                continue
            *lines, rest = pending.split(b"\n")
            pending = bytearray(rest)
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.rstrip(b"\r").decode()

    async def aclose(self) -> None:
        if not self._ended:  # a reply left mid-way: closing its connection tells the backend to stop generating it
            self._connection.drop(BackendError("the reply was closed before its end"))

    async def _body(self) -> AsyncIterator[bytes]:
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._size -= len(chunk)
                if self._size < _HIGH_WATER // 2 and not self._ended:  # once ended, the connection is not ours
                    self._connection.resume()
                yield chunk
            if self._error is not None:
                raise self._error
            if self._ended:
                return
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    # ---------------------------------------------------------------------------- from the connection

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER:
            self._connection.pause()
        self._wakeup()

    def _end(self) -> None:
        self._ended = True
        self._wakeup()

    def _fail(self, error: BackendError) -> None:
        if not self._ended:
            self._error = error
            self._wakeup()


class _Connection(asyncio.Protocol):
    """One connection to a backend, one exchange at a time. `release` is called once per exchange: with True when
    the reply came whole and the connection can take another request."""

    def __init__(self, client: "BackendClient", key: tuple[str, int, bool]):
        self.client, self.key = client, key
        self.loop = client.loop
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future | None = None  # the reply, once its headers are in
        self._reply: Upstream | None = None
        self._raw: list[tuple[bytes, bytes]] = []
        self._by_close = False  # the reply's body ends when the connection closes (no length, not chunked)
        self._busy = False
        self._paused = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def send(self, request: bytes) -> Upstream:
        if not self.open:  # closed by the backend between its making and this request
            raise BackendError("the backend closed the connection before the request")
        self._busy, self._last_read = True, self.loop.time()
        self._head = self.loop.create_future()
        self._timer = self.loop.call_at(self._last_read + self.client.read_s, self._check_read)
        self.transport.write(request)
        return await self._head

    def drop(self, error: BackendError) -> None:
        """End the exchange with `error` and close the connection."""
        self._finish(error)
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.open:
            self._paused = False
            self.transport.resume_reading()

    def _finish(self, error: BackendError | None) -> None:
        """The exchange is over: whole (error None) or failed; the connection goes back to the pool or away."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        head, reply = self._head, self._reply
        self._head = self._reply = None
        if error is not None:
            if head is not None and not head.done():
                head.set_exception(error)
            if reply is not None:
                reply._fail(error)
            self.open = False
        else:
            self.resume()  # a reply that ended while its reader was behind: the next exchange reads again
            if reply is not None:
                reply._end()
        if self._busy:
            self._busy = False
            self.client.release(self, error is None and self._parser.should_keep_alive())

    def _check_read(self) -> None:
        self._timer = None
        quiet = self.loop.time() - self._last_read
        if quiet < self.client.read_s:  # data came since: wait out the rest
            self._timer = self.loop.call_at(self._last_read + self.client.read_s, self._check_read)
        else:
            self.drop(BackendError(f"the backend sent nothing for {self.client.read_s:g}s"))

    # ------------------------------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.open = transport, True  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a request's bytes go out at once, not held for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        if not self._busy:  # bytes with no request outstanding: the stream is out of step
            self.drop(BackendError("the backend sent bytes no request asked for"))
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self.drop(BackendError(f"the backend's reply is not valid HTTP/1.1 ({type(e).__name__}: {e})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        if self._reply is not None and self._by_close and exc is None:
            error = None  # a body ended by the close: whole
        else:
            what = "its reply broke off" if self._reply is not None else "before its reply"
            error = BackendError(f"the backend closed the connection {what}"
                                 + (f" ({type(exc).__name__}: {exc})" if exc else ""))
        self._finish(error)
        self.client.forget(self)

    # ------------------------------------------------------------------------ httptools' callbacks

    def on_message_begin(self) -> None:
        if not self._busy:  # a second reply to one request: raised through the parser, the connection is dropped
            raise BackendError("the backend sent a reply no request asked for")
        self._raw = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        headers = Headers(raw=self._raw)
        self._by_close = "content-length" not in headers and "chunked" not in \
            headers.get("transfer-encoding", "").lower()
        self._reply = Upstream(self, self._parser.get_status_code(), headers)
        if self._head is not None and not self._head.done():
            self._head.set_result(self._reply)

    def on_body(self, body: bytes) -> None:
        if self._reply is not None:
            self._reply._feed(body)

    def on_message_complete(self) -> None:
        self._finish(None)


class BackendClient:
    """POSTs to backends over kept-alive connections. Made on the event loop that uses it; `close_from_thread`
    closes it from another thread while that loop runs."""

    def __init__(self, *, idle_s: float, connect_s: float = 10, read_s: float = 600, max_connections: int = 1024):
        # An idle connection is not reused after `idle_s`: before the backend's own keep-alive can close it under a
        # request. `read_s`: a reply that sends nothing for that long fails. At most `max_connections` exchanges
        # at once (each holds one connection); more wait.
        self.loop = asyncio.get_running_loop()
        self.idle_s, self.connect_s, self.read_s, self.max_connections = idle_s, connect_s, read_s, max_connections
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._busy = 0
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._closed = False
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> Upstream:
        """The backend's reply to a POST of `content`, once its headers are in; raises a `BackendError` (`Refused`
        when no connection could be made)."""
        key, head = _target(url)
        request = b"".join((head, _header_lines(headers), b"Content-Length: %d\r\n\r\n" % len(content), content))
        connection = await self._acquire(key)
        try:
            return await connection.send(request)
        except BaseException:  # cancelled (the agent went away) or failed: the request may be half sent
            connection.drop(BackendError("the request was abandoned"))
            raise

    def release(self, connection: _Connection, reusable: bool) -> None:
        """An exchange is over (called by the connection, once per exchange)."""
        self._busy -= 1
        if reusable and connection.open and not self._closed:
            connection.idle_since = self.loop.time()
            self._idle.setdefault(connection.key, []).append(connection)
        elif connection.transport is not None:
            connection.transport.close()
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def forget(self, connection: _Connection) -> None:
        self._all.discard(connection)

    async def aclose(self) -> None:
        """Close every connection (on the client's loop)."""
        self._closed = True
        for connection in list(self._all):
            connection.drop(BackendError("the gateway's client closed"))
        self._idle.clear()

    def close_from_thread(self, timeout_s: float = 5.0) -> None:
        """`aclose` from another thread, waiting at most `timeout_s` (a loop that is gone closes them with it)."""
        if self.loop.is_running() and not self._closed:
            try:
                asyncio.run_coroutine_threadsafe(self.aclose(), self.loop).result(timeout_s)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass

    async def _acquire(self, key: tuple[str, int, bool]) -> _Connection:
        if self._closed:
            raise BackendError("the gateway's client is closed")
        while self._busy >= self.max_connections:
            waiter = self.loop.create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled: the turn goes to the next
                    self._wake_one()
                raise
        self._busy += 1
        idle, now = self._idle.get(key), self.loop.time()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be near its keep-alive's end
            if connection.open and now - connection.idle_since < self.idle_s:
                return connection
            connection.transport.close()
        connection = _Connection(self, key)
        host, port, tls = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: connection, host, port,
                                                               ssl=self._tls if tls else None), self.connect_s)
        except (OSError, asyncio.TimeoutError) as e:
            self.release(connection, False)
            raise Refused(f"no connection to {host}:{port} ({type(e).__name__}: {e})") from None
        except BaseException:
            self.release(connection, False)
            raise
        self._all.add(connection)
        return connection
