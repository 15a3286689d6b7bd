"""The Responses router under test behind a small FastAPI app on 127.0.0.1, forwarding its chat requests to a real
built-in server (the gateway will take this app's place)."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from lightning_sdk.serving.process import auth_headers, free_port
from lightning_sdk.serving.responses import responses_router

API_KEY = "test-key"


BREAK_MIDSTREAM = "break-midstream"  # a request with this `user` goes to a backend that fails mid-stream


class ResponsesApp:
    """`base_url` serves /v1/responses; `paths` lists the routes agents called, `chat_bodies` what went on."""

    def __init__(self, server, **router_kwargs):
        self.server, self.router_kwargs = server, router_kwargs
        self.paths: list[str] = []
        self.chat_bodies: list[dict] = []
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._uvicorn: uvicorn.Server | None = None

    async def _send(self, body: dict) -> httpx.Response:
        self.chat_bodies.append(body)
        body = {**body, "model": self.server.served_model_name}  # every name is served by the one model
        url = (f"http://127.0.0.1:{self.port}/broken/v1" if body.get("user") == BREAK_MIDSTREAM
               else self.server.base_url)
        request = self._client.build_request("POST", f"{url}/chat/completions", json=body,
                                             headers=auth_headers(self.server.api_key))
        return await self._client.send(request, stream=True)

    def start(self) -> "ResponsesApp":
        app = FastAPI(telemetry={"tracing": False})  # FastAPI's own spans would reach the global provider
        self._client = httpx.AsyncClient(timeout=60)

        @app.middleware("http")
        async def note(request: Request, call_next):
            self.paths.append(f"{request.method} {request.url.path}")
            return await call_next(request)

        @app.post("/broken/v1/chat/completions")
        async def broken(request: Request) -> StreamingResponse:
            """A backend that fails after its first token, reporting it in the stream as vLLM does: the server's
            own chunks up to the first piece of text, then an error chunk."""
            upstream = await self._client.send(self._client.build_request(
                "POST", f"{self.server.base_url}/chat/completions", content=await request.body(),
                headers={"content-type": "application/json", **auth_headers(self.server.api_key)}), stream=True)

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

        app.include_router(responses_router(self._send, **self.router_kwargs))
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                      lifespan="off"))
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        for _ in range(600):  # up to 30 s
            if self._uvicorn.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("the test app did not start")

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
