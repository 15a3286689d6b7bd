"""The one OpenAI-compatible address an agent calls during a run, whatever runtime runs the agent.

- Every model name the agent asks for is served by the policy being trained (`Gateway.policy`, set for each
  phase), so an agent that names its own model (`model="gpt-4o-mini"`) trains unchanged. With
  `serve.model_names` only those names are served (others get 404). Each new name is logged once.
- Chat completions are forwarded asking for token ids and log-probs (`return_token_ids`, `logprobs`: vLLM's
  fields, which the built-in server honours too), so every client's response carries them, whatever language it
  is written in (a Python agent traced by lightning_sdk gets log-probs only if it asked: tracing reads them and
  takes them off the reply). The Responses API is served over chat completions (`gateway/responses.py`).
- Several backends (the Ray runtime's server actors): each request goes to the one with the fewest in flight.
- Agents hold the gateway's key only. The backends' key, which can swap adapters, stays in the runtime, and
  adapter control goes to the backends directly, never through here.

The socket is bound when the gateway is made (`serve.host`/`serve.port`), so its URL can go into the agent's
environment before the agent module is imported; `start` serves it from a thread of this process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import Counter
from typing import Any, Sequence

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightning_sdk.gateway.guard import MAX_BODY_BYTES, BodyLimit, GatewayError, KeyCheck, error_body, parse_off_loop
from lightning_sdk.gateway.listen import ThreadedServer, bind, url_of
from lightning_sdk.gateway.responses import responses_router

log = logging.getLogger("lightning_sdk")  # the runtime's logger: which names the agent asked for is part of a run

_MAX_NAMES = 1000  # distinct model names remembered: a caller cycling through names cannot grow this forever
_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class Backends:
    """In-flight counts per backend root URL; `pick` is the least-loaded (ties: the least recently picked)."""

    def __init__(self, urls: Sequence[str]):
        if not urls:
            raise ValueError("a gateway needs at least one backend url")
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = [0] * len(self.urls)
        self.served = [0] * len(self.urls)
        self._last = [0] * len(self.urls)
        self._tick = itertools.count(1)

    def pick(self) -> int:
        i = min(range(len(self.urls)), key=lambda k: (self.in_flight[k], self._last[k], k))
        self.in_flight[i] += 1
        self.served[i] += 1
        self._last[i] = next(self._tick)
        return i

    def done(self, i: int) -> None:
        self.in_flight[i] -= 1


class Gateway:
    """See the module docstring. `Gateway(...)` binds; `add_routes` (optional) then `start` serves; `stop` ends."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, api_key: str, model_names: Sequence[str] = ()):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.api_key = api_key
        self.model_names = tuple(model_names)
        self.policy: str | None = None  # every request is served by this adapter (or base model) name
        self.asked: Counter[str] = Counter()  # model names the agent asked for, and how often
        self.backends: Backends | None = None
        self._sock = bind(host, port)
        self.url = url_of(self._sock)
        self._routers: list[APIRouter] = []
        self._server: ThreadedServer | None = None
        self._client: httpx.AsyncClient | None = None
        self._backend_headers: dict[str, str] = {}

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def add_routes(self, router: APIRouter) -> None:
        """More routes on the same address, behind the same key (the remote runtime's work and OTLP routes)."""
        if self._server is not None:
            raise RuntimeError("add_routes must come before start")
        self._routers.append(router)

    def start(self, backends: Sequence[str], *, backend_key: str | None) -> None:
        """Serve, forwarding to `backends` (roots: http://host:port) with `backend_key`."""
        self.backends = Backends(backends)
        self._backend_headers = {"Content-Type": "application/json"}
        if backend_key:
            self._backend_headers["Authorization"] = f"Bearer {backend_key}"
        self._server = ThreadedServer(self._app(), self._sock, name="lightning-gateway")
        self._server.start()

    def is_alive(self) -> bool:
        return self._server is not None and self._server.is_alive()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._sock.close()

    # ------------------------------------------------------------------------------------------ model names

    def serve_as(self, asked: Any) -> str:
        """The name a request for model `asked` is served under: the policy; GatewayError if it is not served."""
        if not isinstance(asked, str) or not asked:
            raise GatewayError(400, "model: expected the name of a model (a non-empty string)", "model")
        if self.policy is None:
            raise GatewayError(503, "no policy is being served right now (between runs)")
        if self.model_names and asked not in self.model_names and asked != self.policy:
            raise GatewayError(404, f"The model `{asked[:200]}` does not exist: this run serves the policy being "
                                    f"trained as {list(self.model_names)} (serve.model_names)", "model")
        if asked not in self.asked and len(self.asked) < _MAX_NAMES:
            if asked != self.policy:
                log.info("the agent asked for model %r: served by the policy being trained (%s)", asked[:200],
                         "serve.model_names lists it" if self.model_names else "any name is; serve.model_names "
                         "restricts them")
            self.asked[asked] = 0
        if asked in self.asked:
            self.asked[asked] += 1
        return self.policy

    # --------------------------------------------------------------------------------------------- the app

    def _app(self) -> FastAPI:
        app = FastAPI(title="lightning-sdk gateway", telemetry={"tracing": False})
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10),
                                         limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

        @app.exception_handler(GatewayError)
        async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
            if e.status >= 500:
                log.warning("gateway: %s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
            return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict:
            names = [self.policy] if self.policy else []
            names += [n for n in self.model_names if n not in names]
            return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "lightning-sdk"}
                                               for n in names]}

        @app.get("/gateway/stats")
        async def stats() -> dict:
            b = self.backends
            return {"policy": self.policy, "asked": dict(self.asked), "backends": b.urls, "in_flight": b.in_flight,
                    "served": b.served}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            upstream = await self.send_chat(await _json_body(request))
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            if "text/event-stream" not in upstream.headers.get("content-type", ""):
                try:
                    content = await upstream.aread()
                finally:
                    await upstream.aclose()
                return Response(content, upstream.status_code, headers=out_headers)

            async def relay():
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:  # also when the client goes away mid-stream
                    await upstream.aclose()

            return StreamingResponse(relay(), upstream.status_code, headers=out_headers)

        for router in self._routers:  # before the Responses route: an added /v1/responses (a test's) wins
            app.include_router(router)
        app.include_router(responses_router(self.send_chat))
        app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
        app.add_middleware(KeyCheck, api_key=self.api_key)  # added last = runs first: before the body is read
        return app

    async def send_chat(self, body: dict) -> httpx.Response:
        """Send a chat-completions request to the least-loaded backend, served by the policy and asking for token
        ids and log-probs; the backend's response, opened as a stream (the caller reads it, then `aclose()`s it,
        which also counts the request done). The `ChatSender` of gateway/responses.py."""
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        body = {**body, "model": self.serve_as(body.get("model")), "return_token_ids": True}
        if not body.get("logprobs"):
            body["logprobs"] = True
        # In a thread: a long conversation is megabytes of JSON, and serialising it must not stall the loop (the
        # hop costs tens of microseconds, next to a generation's milliseconds).
        content = (await asyncio.to_thread(json.dumps, body)).encode()
        backends = self.backends
        i = backends.pick()
        try:
            req = self._client.build_request("POST", f"{backends.urls[i]}/v1/chat/completions", content=content,
                                             headers=self._backend_headers)
            upstream = await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            backends.done(i)
            raise GatewayError(502, f"the inference server at {backends.urls[i]} is unreachable ({type(e).__name__})")
        close, done = upstream.aclose, False

        async def aclose() -> None:
            nonlocal done
            try:
                await close()
            finally:
                if not done:
                    done = True
                    backends.done(i)

        upstream.aclose = aclose  # type: ignore[method-assign]  # in-flight counts end with the response
        return upstream


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return await parse_off_loop(raw, json.loads)
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "the request body is not valid JSON") from None
