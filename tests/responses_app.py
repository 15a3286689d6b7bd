"""The Responses router under test, mounted on the real Gateway (gateway/proxy.py) in front of a real built-in
server on 127.0.0.1; it records the chat requests the router sent."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from lightning_sdk.gateway.proxy import Gateway, Sent
from lightning_sdk.servers.process import auth_headers
from lightning_sdk.gateway.responses import responses_router
from lightning_sdk.gateway.upstream import BackendClient

BREAK_MIDSTREAM = "break-midstream"  # a request with this `user` goes to a backend that fails mid-stream


class ResponsesApp:
    """`base_url` / `api_key` are the gateway's; `chat_bodies` lists the chat requests /v1/responses made."""

    def __init__(self, server, **router_kwargs):
        self.server, self.router_kwargs = server, router_kwargs
        self.gateway = Gateway(api_key="agents-key")
        self.base_url, self.api_key = self.gateway.base_url, self.gateway.api_key
        self.auth = auth_headers(self.api_key)
        self.chat_bodies: list[dict] = []

    async def _send(self, body: dict, request: Request, api: str) -> Sent:
        self.chat_bodies.append(body)
        sent = await self.gateway.send_chat(body, request, api)
        if body.get("user") != BREAK_MIDSTREAM:
            return sent
        await sent.response.aclose()  # the gateway's record of it stays; the reply comes from the broken backend
        broken = await self._client().post(f"{self.gateway.url}/broken/v1/chat/completions", json.dumps(body).encode(),
                                           {**self.auth, "Content-Type": "application/json"})
        return Sent(broken, sent.call, logprobs=False, token_ids=False)

    def _client(self) -> BackendClient:
        """One client, made on the gateway's event loop (where these routes run)."""
        if self._backend is None:
            self._backend = BackendClient(idle_s=2.0)
        return self._backend

    @property
    def chat_calls(self) -> int:
        """Chat requests the gateway sent its backend (from /v1/responses or /v1/chat/completions)."""
        return sum(self.gateway.backends.served)

    def start(self) -> "ResponsesApp":
        self._backend: BackendClient | None = None
        broken = APIRouter()

        @broken.post("/broken/v1/chat/completions")
        async def fail_midstream(request: Request) -> StreamingResponse:
            """A backend that fails after its first token, reporting it in the stream as vLLM does: the server's
            own chunks up to the first piece of text, then an error chunk."""
            body = {**await request.json(), "model": self.server.served_model_name}
            upstream = await self._client().post(f"{self.server.base_url}/chat/completions", json.dumps(body).encode(),
                                                 {**auth_headers(self.server.api_key),
                                                  "Content-Type": "application/json"})

            async def relay():
                try:
                    async for line in upstream.aiter_lines():
                        if line.startswith("data: "):
                            yield f"{line}\n\n"
                            if '"content": ""' not in line:
                                break
                    yield 'data: {"error": {"message": "the engine died", "type": "InternalServerError", ' \
                          '"param": null, "code": 500}}\n\n'
                finally:
                    await upstream.aclose()

            return StreamingResponse(relay(), media_type="text/event-stream")

        self.gateway.add_routes(broken)
        self.gateway.add_routes(responses_router(self._send, **self.router_kwargs))
        self.gateway.start([self.server.url], backend_key=self.server.api_key,
                           grammar=self.server.grammar)
        self.gateway.policy = self.server.served_model_name
        return self

    def stop(self) -> None:
        if self._backend is not None:
            self._backend.close_from_thread()
        self.gateway.stop()
