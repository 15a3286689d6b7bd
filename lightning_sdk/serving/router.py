"""One OpenAI-compatible address in front of several inference servers: least-loaded routing, adapter fan-out.

Chat completions (streamed or not) go to the backend with the fewest requests in flight (ties: the one that
was picked least recently), so a slow server does not collect a queue while others idle. LoRA loads and unloads
go to every backend, so all of them serve the same policy; the call fails if any backend refuses it.
The router runs as a uvicorn server in a thread of the process that owns it (the Ray runtime's driver).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightning_sdk.serving import ServerError
from lightning_sdk.serving.guard import KeyCheck, connection_cap, guarded_protocol
from lightning_sdk.serving.process import auth_headers, free_port

_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class Backends:
    """In-flight counts per backend; `pick` is the least-loaded choice."""

    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("a router needs at least one backend url")
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = [0] * len(urls)
        self.served = [0] * len(urls)
        self._last = [0] * len(urls)
        self._tick = itertools.count(1)

    def pick(self) -> int:
        i = min(range(len(self.urls)), key=lambda k: (self.in_flight[k], self._last[k], k))
        self.in_flight[i] += 1
        self.served[i] += 1
        self._last[i] = next(self._tick)
        return i

    def done(self, i: int) -> None:
        self.in_flight[i] -= 1


def create_router_app(urls: list[str], *, api_key: str | None = None) -> FastAPI:
    """`urls` are backend roots (http://host:port, no /v1). With `api_key`, every route but /health needs it (the
    same key as the backends', which the router forwards)."""
    backends = Backends(urls)
    app = FastAPI(title="lightning-sdk router")
    app.state.backends = backends
    client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=httpx.Limits(max_connections=1024))
    auth = auth_headers(api_key)

    def headers(request: Request) -> dict:
        h = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        return h or {"content-type": "application/json", **auth}

    @app.get("/health")
    async def health() -> JSONResponse:
        async def one(u: str) -> bool:
            try:
                return (await client.get(f"{u}/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                return False
        ok = await asyncio.gather(*(one(u) for u in backends.urls))
        body = {"status": "ok" if all(ok) else "degraded", "backends": dict(zip(backends.urls, ok))}
        return JSONResponse(body, status_code=200 if all(ok) else 503)

    @app.get("/router/stats")
    async def stats() -> dict:
        return {"backends": backends.urls, "in_flight": backends.in_flight, "served": backends.served}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await client.get(f"{backends.urls[0]}/v1/models", headers=headers(request))
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        i = backends.pick()
        try:
            req = client.build_request("POST", f"{backends.urls[i]}/v1/chat/completions", content=body,
                                       headers=headers(request))
            upstream = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            backends.done(i)
            return JSONResponse({"error": {"message": f"backend {backends.urls[i]} unreachable: {e}",
                                           "type": "server_error", "code": 502}}, status_code=502)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        if "text/event-stream" not in upstream.headers.get("content-type", ""):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                backends.done(i)
            return Response(content, upstream.status_code, headers=out_headers)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when the client goes away mid-stream
                await upstream.aclose()
                backends.done(i)

        return StreamingResponse(relay(), upstream.status_code, headers=out_headers)

    async def fan_out(request: Request, route: str) -> JSONResponse:
        body = await request.body()
        rs = await asyncio.gather(*(client.post(f"{u}{route}", content=body, headers=headers(request))
                                    for u in backends.urls), return_exceptions=True)
        failed = []
        for u, r in zip(backends.urls, rs):
            if isinstance(r, Exception):
                failed.append(f"{u}: unreachable ({r})")
            elif r.status_code != 200:
                failed.append(f"{u}: {r.status_code} {r.text[:300]}")
        if failed:
            code = next((r.status_code for r in rs if not isinstance(r, Exception) and r.status_code != 200), 502)
            return JSONResponse({"error": {"message": f"{route} failed on {len(failed)} of {len(rs)} servers: "
                                                      + "; ".join(failed), "type": "server_error", "code": code}},
                                status_code=code)
        return JSONResponse({"message": f"{route}: done on {len(rs)} servers"})

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> JSONResponse:
        return await fan_out(request, "/v1/load_lora_adapter")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        return await fan_out(request, "/v1/unload_lora_adapter")

    if api_key is not None:
        app.add_middleware(KeyCheck, api_key=api_key)
    return app


class Router:
    """The router app served by uvicorn in a daemon thread; `start()` returns once /health answers."""

    def __init__(self, urls: list[str], *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        self.urls, self.host, self.port, self.api_key = urls, host, port, api_key
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self, timeout: float = 30) -> None:
        import uvicorn

        if self.port == 0:
            self.port = free_port(self.host)
        app = create_router_app(self.urls, api_key=self.api_key)
        protocol = guarded_protocol(max_connections=connection_cap(2048))  # header timeout and connection cap
        self._server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                     lifespan="off", http=protocol))
        self._thread = threading.Thread(target=self._server.run, name="lightning-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._server.started:
                return
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise ServerError(f"router on {self.url} did not start within {timeout:.0f}s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
