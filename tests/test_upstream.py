"""The gateway's backend client (gateway/upstream.py) against a real server on 127.0.0.1: a streamed reply's lines
come whole however long (a chunk carrying a long prompt's token ids is one line), and a reply left mid-way
drops its connection, which is how a backend learns to stop generating it. Against a scripted server: each way a
reply's end is framed, connections kept alive and reused, and each fault (a reply cut short, a silent backend,
bytes that are not HTTP, no listener, the connection cap, an abandoned request) failing that request alone."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from lightning_sdk.gateway.listen import ThreadedServer, bind, url_of
from lightning_sdk.gateway.upstream import BackendClient, BackendError, Refused

LONG = list(range(60_000))  # ~350 kB of JSON on one line: past aiohttp's readline limit


def test_long_lines_whole_and_an_abandoned_reply_drops_its_connection():
    seen_gone: list[bool] = []

    async def stream(request: Request) -> StreamingResponse:
        endless = (await request.json()).get("endless", False)

        async def lines():
            yield f"data: {json.dumps({'prompt_token_ids': LONG})}\n\n"
            yield "data: [DONE]\n\n"
            try:
                while endless:  # until the client goes: Starlette then cancels this stream
                    yield "data: {}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                if endless:
                    seen_gone.append(True)

        return StreamingResponse(lines(), media_type="text/event-stream")

    sock = bind("127.0.0.1", 0)
    server = ThreadedServer(Starlette(routes=[Route("/s", stream, methods=["POST"])]), sock, name="upstream-test")
    server.start()
    url = f"{url_of(sock)}/s"

    async def run() -> list[str]:
        client = BackendClient(idle_s=2.0)
        try:
            reply = await client.post(url, b"{}", {"Content-Type": "application/json"})
            lines = [line async for line in reply.aiter_lines() if line]
            await reply.aclose()
            endless = await client.post(url, b'{"endless": true}', {"Content-Type": "application/json"})
            async for line in endless.aiter_lines():
                if line == "data: [DONE]":
                    break
            await endless.aclose()
            for _ in range(300):  # the server notices within its next few chunks
                if seen_gone:
                    break
                await asyncio.sleep(0.01)
            return lines
        finally:
            await client.aclose()

    try:
        lines = asyncio.run(run())
    finally:
        server.stop()
        sock.close()
    assert lines[0].startswith("data: ") and json.loads(lines[0][6:])["prompt_token_ids"] == LONG
    assert lines[1:] == ["data: [DONE]"]
    assert seen_gone == [True], "the server never saw the abandoned reply's connection close"


# ---- the exchange itself, against a scripted server on 127.0.0.1 that answers each request with given bytes

class Scripted:
    """A TCP server on 127.0.0.1 whose `answer(request_bytes, writer)` coroutine replies to each request; it counts
    connections and sees each request whole (headers and Content-Length body)."""

    def __init__(self, answer):
        self.answer, self.connections, self.requests = answer, 0, []

    async def __aenter__(self) -> "Scripted":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/x"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                if await self.answer(self.requests[-1], writer) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()


def reply(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def scripted(answer, run):
    """`run(server)`'s result and the server, `answer` replying to each request."""
    async def main():
        async with Scripted(answer) as server:
            return await run(server), server

    return asyncio.run(main())


def test_replies_of_every_framing_come_whole_over_one_kept_alive_connection():
    answered = 0

    async def answer(request: bytes, writer) -> bool | None:
        nonlocal answered
        answered += 1
        if answered == 1:  # Content-Length, headers and body in separate writes
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Lightning-Call-Id: abc\r\n\r\n")
            await writer.drain()
            writer.write(b"hello")
        elif answered == 2:  # chunked, a chunk at a time
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for part in (b"ab", b"cde"):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:  # no length, not chunked: the body ends with the connection
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil close")
            return False

    async def run(server) -> list:
        client = BackendClient(idle_s=2.0)
        got = []
        for _ in range(3):
            up = await client.post(server.url, b'{"a": 1}', {"Content-Type": "application/json"})
            got.append((up.status_code, up.headers.get("x-lightning-call-id"), await up.aread()))
            await up.aclose()
        await client.aclose()
        return got

    got, server = scripted(answer, run)
    assert got == [(200, "abc", b"hello"), (200, None, b"abcde"), (200, None, b"until close")]
    assert server.connections == 1  # the first two reused one connection; the third ended it
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:") and first.endswith(b'\r\n\r\n{"a": 1}')
    assert b"Content-Type: application/json\r\n" in first and b"Content-Length: 8\r\n" in first


def test_a_reply_cut_short_a_silent_backend_and_bytes_that_are_not_http_each_fail_that_request_alone():
    async def answer(request: bytes, writer) -> bool | None:
        what = request.rsplit(b"\r\n\r\n", 1)[1]
        if what == b"short":  # promises 100 bytes, sends 3, closes
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc")
            return False
        if what == b"silent":
            await asyncio.sleep(5)
            return False
        if what == b"garbage":
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            return False
        writer.write(reply(b"ok"))

    async def run(server) -> list[str]:
        client = BackendClient(idle_s=2.0, read_s=0.3)
        outcomes = []
        for what in (b"short", b"silent", b"garbage", b"fine"):
            try:
                up = await client.post(server.url, what, {})
                outcomes.append((await up.aread()).decode())
            except BackendError as e:
                outcomes.append(str(e))
        await client.aclose()
        return outcomes

    (short, silent, garbage, fine), server = scripted(answer, run)
    assert "broke off" in short
    assert "sent nothing for" in silent
    assert "not valid HTTP/1.1" in garbage
    assert fine == "ok"


def test_no_listener_is_refused_and_an_idle_connection_past_idle_s_is_not_reused():
    async def answer(request: bytes, writer) -> None:
        writer.write(reply(b"ok"))

    async def run(server) -> None:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nothing listens there now
        client = BackendClient(idle_s=0.2)
        with pytest.raises(Refused):
            await client.post(f"http://127.0.0.1:{port}/v1/x", b"{}", {})
        for pause in (0, 0.4):
            await asyncio.sleep(pause)
            up = await client.post(server.url, b"{}", {})
            assert await up.aread() == b"ok"
        await client.aclose()

    _, server = scripted(answer, run)
    assert server.connections == 2  # the pause past idle_s made the second request open a new connection


def test_at_most_max_connections_exchanges_at_once_and_an_abandoned_request_frees_its_place():
    inside, most = 0, 0

    async def answer(request: bytes, writer) -> None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await asyncio.sleep(0.05)
        inside -= 1
        writer.write(reply(b"ok"))

    async def run(server) -> None:
        client = BackendClient(idle_s=2.0, max_connections=2)

        async def one() -> bytes:
            up = await client.post(server.url, b"{}", {})
            return await up.aread()

        slow = asyncio.ensure_future(one())
        await asyncio.sleep(0.01)
        slow.cancel()  # the agent went away while its request was at the backend
        with pytest.raises(asyncio.CancelledError):
            await slow
        await asyncio.sleep(0.1)  # its handler at the server ends (it learns of the close only when it writes)
        assert await asyncio.gather(*(one() for _ in range(6))) == [b"ok"] * 6
        await client.aclose()

    _, server = scripted(answer, run)
    assert most <= 2
    assert server.connections <= 3  # the abandoned request's connection was closed, two served the six


def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent():
    async def run() -> None:
        client = BackendClient(idle_s=2.0)
        with pytest.raises(ValueError, match="line break"):
            await client.post("http://127.0.0.1:9/v1/x", b"{}", {"Authorization": "Bearer k\r\nX-Evil: 1"})
        await client.aclose()

    asyncio.run(run())


def test_a_reply_that_ends_past_the_read_buffer_unread_leaves_its_connection_serving_the_next():
    big = b"x" * ((1 << 20) + 100)  # just past the 1 MiB the client holds unread before it stops reading the socket

    async def answer(request: bytes, writer) -> None:
        if request.endswith(b"small"):
            writer.write(reply(b"small"))
            return
        whole = reply(big)
        writer.write(whole[:-200])  # under the limit: read on
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(whole[-200:])  # over it, and the end: the socket is paused as the reply ends

    async def run(server) -> list[int]:
        client = BackendClient(idle_s=2.0, read_s=5)
        first = await client.post(server.url, b"big", {})
        await asyncio.sleep(0.3)  # the reply has ended, not yet read: its connection goes back to the pool
        second = await asyncio.wait_for(client.post(server.url, b"small", {}), 2)
        sizes = [len(await asyncio.wait_for(second.aread(), 2)), len(await first.aread())]
        await client.aclose()
        return sizes

    sizes, server = scripted(answer, run)
    assert sizes == [5, len(big)]
    assert server.connections == 1
