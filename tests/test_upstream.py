"""The gateway's backend client (gateway/upstream.py) against a real server on 127.0.0.1: a streamed reply's lines
come whole however long (a chunk carrying a long prompt's token ids is one line), and a reply left mid-way
drops its connection, which is how a backend learns to stop generating it."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from lightning_sdk.gateway.listen import ThreadedServer, bind, url_of
from lightning_sdk.gateway.upstream import BackendClient

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
