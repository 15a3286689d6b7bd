"""The gateway's client to its backends: one aiohttp session (a pool of kept-alive connections) per gateway.

aiohttp rather than httpx here: on the gateway's event loop, where every call's hop is paid, httpx's async stack
(httpcore over anyio) costs several times aiohttp's CPU per request and writes a request's headers and body in
two sends (benchmarks/tracing_overhead.py, `hop_cpu_us`). `Upstream` reads like the `httpx.Response` a client
opens with `stream=True`, so the routes read a backend's reply one way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import AsyncIterator, Mapping

import aiohttp

# What a failed exchange with a backend raises: the connection refused or broken, a reply cut off, a timeout.
BackendError = (aiohttp.ClientError, asyncio.TimeoutError)
# Of those, the ones where nothing reached the backend (no connection made): another replica may take the request.
Refused = aiohttp.ClientConnectorError


class Upstream:
    """A backend's reply, its status and headers received, its body still to be read (once: `aread` or
    `aiter_lines`); `aclose` gives the connection back (or drops it, when the body was not read to its end)."""

    def __init__(self, response: aiohttp.ClientResponse):
        self._response = response
        self.status_code = response.status
        self.headers: Mapping[str, str] = response.headers  # case-insensitive, as HTTP headers are

    async def aread(self) -> bytes:
        return await self._response.read()

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines, without their line ends. Split here, not by aiohttp's readline, which refuses a line
        over its buffer's limit: a streamed chunk carrying a long prompt's token ids is one long line."""
        pending = bytearray()
        async for data in self._response.content.iter_any():
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
        if self._response.content.at_eof():
            self._response.release()
        else:  # a reply left mid-way: closing its connection is what tells the backend to stop generating it
            self._response.close()


class BackendClient:
    """POSTs to backends over kept-alive connections. Made on the event loop that uses it; `close_from_thread`
    closes it from another thread while that loop runs."""

    def __init__(self, *, idle_s: float, connect_s: float = 10, read_s: float = 600, max_connections: int = 1024):
        # An idle connection is dropped after `idle_s`, before the backend's own keep-alive can close it under a
        # request reusing it.
        self._loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=idle_s),
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_s, sock_read=read_s))

    async def post(self, url: str, content: bytes, headers: Mapping[str, str]) -> Upstream:
        """The backend's reply to a POST of `content`, once its headers are in; raises one of `BackendError`."""
        return Upstream(await self._session.post(url, data=content, headers=headers))

    async def aclose(self) -> None:
        """Close the pool's connections (on the client's loop)."""
        await self._session.close()

    def close_from_thread(self, timeout_s: float = 5.0) -> None:
        """`aclose` from another thread, waiting at most `timeout_s` (a loop that is gone closes them with it)."""
        if self._loop.is_running() and not self._session.closed:
            try:
                asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result(timeout_s)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
