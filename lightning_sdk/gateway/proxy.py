"""The one OpenAI-compatible address an agent calls during a run, whatever runtime runs the agent.

- Every model name the agent asks for is served by the policy being trained (`Gateway.policy`, set for each
  phase), so an agent that names its own model (`model="gpt-4o-mini"`) trains unchanged. With
  `serve.model_names` only those names are served (others get 404). Each new name is logged once.
- With several policies (`Gateway.by_component`) the call's component (its baggage, `ls.component`) picks the
  adapter; a call of a component in no policy is served by `Gateway.policy` (then the base model) and counted in
  `base_served`.
- Every call is recorded here, as the training record (`capture`): chat completions, completions and the
  Responses API (served over chat completions, `gateway/responses.py`), streamed or not. Requests go to the
  backend asking for token ids and log-probs (`return_token_ids`, `logprobs`: vLLM's fields, which the built-in
  server honours too) and with explicit sampling settings; the agent gets back only what it asked for, plus the
  record's id (`x-lightning-call-id`). A call's rollout comes from its `traceparent` or its per-rollout base URL
  (`/rollouts/{key}/v1`, `RolloutPath`).
- Several backends (serve.replicas; the Ray runtime's server actors): each request goes to the one with the fewest
  in flight; one that refuses connections is left out for a while (gateway/routing.py).
- Agents hold the gateway's key only. The backends' key, which can swap adapters, stays in the runtime, and
  adapter control goes to the backends directly, never through here.

The socket is bound when the gateway is made (`serve.host`/`serve.port`), so its URL can go into the agent's
environment before the agent module is imported; `start` serves it from a thread of this process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightning_sdk.constraint import ConstraintError, ServerGrammar, check_size, from_request
from lightning_sdk.gateway.canary_share import routes_to_canary
from lightning_sdk.gateway.capture import CALL_ID_HEADER, Call, Capture, OpenRollouts, origin
from lightning_sdk.gateway.door import Door
from lightning_sdk.gateway.guard import (MAX_BODY_BYTES, PARSE_INLINE_BYTES, BodyLimit, GatewayError, KeyCheck,
                                        error_body, parse_off_loop)
from lightning_sdk.gateway.listen import ThreadedServer, bind, url_of
from lightning_sdk.gateway.responses import responses_router
from lightning_sdk.gateway.routing import Backends
from lightning_sdk.gateway.upstream import BackendClient, BackendError, Refused, Upstream

log = logging.getLogger("lightning_sdk")  # the runtime's logger: which names the agent asked for is part of a run

BACKEND_IDLE_S = 2.0  # seconds an idle connection to a backend is kept: well under its keep-alive
_MAX_NAMES = 1000  # distinct model names remembered: a caller cycling through names cannot grow this forever
_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class Gateway:
    """See the module docstring. `Gateway(...)` binds; `add_routes` (optional) then `start` serves; `stop` ends."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, api_key: str, model_names: Sequence[str] = (),
                 rollouts: OpenRollouts | None = None, store_text: bool = True, sock: socket.socket | None = None):
        """Binds host:port now, or serves `sock` (a socket bound and listening already: gateway/isolated.py's)."""
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.api_key = api_key
        self.rollouts = rollouts or OpenRollouts()  # the runtime opens each rollout here before its agent runs
        # records every call served (its text too, unless store_text is False); `capture.record_to(store)` turns it on
        self.capture = Capture(self.rollouts, store_text=store_text)
        self._route_keys: dict[str, str] = {}
        self.model_names = tuple(model_names)
        self.policy: str | None = None  # every request is served by this adapter (or base model) name
        self.by_component: dict[str, str] = {}  # ...but a call of one of these components by its policy's adapter
        self.base_served: Counter[str] = Counter()  # with by_component: calls of other components, by component
        # Names served earlier in the run: an agent that kept one (a pipelined run switches adapters mid-collection)
        # is served by the policy now, also under serve.model_names.
        self.retired: set[str] = set()
        # (adapter, share): that share of episodes (by trace id, production.canary) is served by the canary adapter.
        self.canary: tuple[str, float] | None = None
        self.asked: Counter[str] = Counter()  # model names the agent asked for, and how often
        self.backends: Backends | None = None
        self.door = Door()  # closed while the backend must take no call (lightning serve: vLLM asleep for an update)
        self._sock = sock if sock is not None else bind(host, port)
        self.url = url_of(self._sock)
        self._routers: list[APIRouter] = []
        self._server: ThreadedServer | None = None
        self._client: BackendClient | None = None  # made on the server's event loop, by its first call
        self._backend_headers: dict[str, str] = {}

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def rollout_base_url(self, key: str) -> str:
        """The base URL of the open rollout `key` (RolloutPath): its calls are attributed to it whatever transport
        sends them, with or without the trace context tracing/propagation.py injects."""
        return f"{self.url}/rollouts/{key}/v1"

    def add_routes(self, router: APIRouter, *, api_key: str | None = None) -> None:
        """More routes on the same address (the remote runtime's work and OTLP routes), behind `api_key` if given
        (a key that then opens those routes only), else behind the gateway's."""
        if self._server is not None:
            raise RuntimeError("add_routes must come before start")
        self._routers.append(router)
        if api_key is not None:
            for route in router.routes:
                self._route_keys[route.path.partition("{")[0]] = api_key

    def start(self, backends: Sequence[str], *, backend_key: str | None, grammar: ServerGrammar | None = None) -> None:
        """Serve, forwarding to `backends` (roots: http://host:port) with `backend_key`; `grammar` (the server's
        own: `server.grammar`) goes into each call's record with its constraint."""
        self.capture.grammar = grammar
        self.backends = Backends(backends)
        self._backend_headers = {"Content-Type": "application/json"}
        if backend_key:
            self._backend_headers["Authorization"] = f"Bearer {backend_key}"
        self._server = ThreadedServer(self._app(), self._sock, name="lightning-gateway")
        self._server.start()

    def is_alive(self) -> bool:
        return self._server is not None and self._server.is_alive()

    def stop(self) -> None:
        if self._client is not None:
            self._client.close_from_thread()
            self._client = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._sock.close()

    # ------------------------------------------------------------------------------------------ model names

    def route(self, policy: str | None, by_component: dict[str, str]) -> None:
        """Serve every call by `policy`, a call of one of `by_component`'s components by its adapter; the names
        served until now are retired (still served, by the policy, to an agent that kept one)."""
        self.retired.update(n for n in [self.policy, *self.by_component.values()] if n is not None)
        self.by_component = dict(by_component)
        self.policy = policy

    def serve_as(self, asked: Any, component: str | None = None, trace_id: str | None = None) -> str:
        """The name a request for model `asked` from `component` is served under: its component's policy, else the
        policy; GatewayError if it is not served."""
        if not isinstance(asked, str) or not asked:
            raise GatewayError(400, "model: expected the name of a model (a non-empty string)", "model")
        if self.policy is None:
            raise GatewayError(503, "no policy is being served right now (between runs)")
        served = self.by_component.get(component) if component is not None else None
        canary = self.canary
        if served is None and canary is not None and trace_id and routes_to_canary(trace_id, canary[1]):
            served = canary[0]
        if self.model_names and asked not in self.model_names and asked != (served or self.policy) \
                and asked not in self.retired:
            raise GatewayError(404, f"The model `{asked[:200]}` does not exist: this run serves the policy being "
                                    f"trained as {list(self.model_names)} (serve.model_names)", "model")
        if asked not in self.asked and len(self.asked) < _MAX_NAMES:
            if asked != self.policy and asked not in self.retired:
                log.info("the agent asked for model %r: served by the policy being trained (%s)", asked[:200],
                         "serve.model_names lists it" if self.model_names else "any name is; serve.model_names "
                         "restricts them")
            self.asked[asked] = 0
        if asked in self.asked:
            self.asked[asked] += 1
        if self.by_component and served is None:
            self.base_served[component or ""] += 1
        return served or self.policy

    # --------------------------------------------------------------------------------------------- the app

    def _app(self) -> Any:
        # No /docs or /openapi.json: they would list every route (the work routes too) to whoever holds a key.
        app = FastAPI(title="lightning-sdk gateway", telemetry={"tracing": False}, docs_url=None, redoc_url=None,
                      openapi_url=None)
        app.add_exception_handler(GatewayError, _gateway_error)
        app.add_exception_handler(RecursionError, _too_deep)

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
            return {"policy": self.policy, "by_component": self.by_component, "base_served": dict(self.base_served),
                    "asked": dict(self.asked), "backends": b.urls, "in_flight": b.in_flight, "served": b.served}

        async def chat(request: Request) -> Response:
            body, size = await _json_body(request)
            return await self._relay(await self.send_chat(body, request, "chat.completions", body_bytes=size))

        async def completions(request: Request) -> Response:
            body, size = await _json_body(request)
            return await self._relay(await self.send_chat(body, request, "completions", body_bytes=size))

        calls = {"/v1/chat/completions": chat, "/v1/completions": completions}
        for path, handler in calls.items():  # POSTs are served by CallRoutes; here the app's 405 to other methods
            app.add_route(path, handler, methods=["POST"])
        for router in self._routers:  # before the Responses route: an added /v1/responses (a test's) wins
            app.include_router(router)
        app.include_router(responses_router(self.send_chat))
        # The key check runs first, then the rollout's path, then the body limit, whatever route follows.
        return KeyCheck(RolloutPath(BodyLimit(CallRoutes(app, calls), limit=MAX_BODY_BYTES)), api_key=self.api_key,
                        route_keys=self._route_keys)

    async def _relay(self, sent: Sent) -> Response:
        """The backend's reply to the agent, recorded on the way: token ids and log-probs it did not ask for are
        taken off (the record keeps them), and the record's id goes back in the `x-lightning-call-id` header."""
        upstream, call = sent.response, sent.call
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        headers[CALL_ID_HEADER] = call.call_id
        if "text/event-stream" not in upstream.headers.get("content-type", ""):
            try:
                content = await upstream.aread()
            except BackendError as e:
                call.fail(502, f"the backend's reply broke off: {type(e).__name__}")
                call.end()
                raise GatewayError(502, f"the backend's reply broke off ({type(e).__name__})") from None
            finally:
                await upstream.aclose()
            if upstream.status_code >= 400:
                call.fail(upstream.status_code, content[:2000].decode("utf-8", "replace"))
                call.end()
                return Response(content, upstream.status_code, headers=headers)
            try:
                reply, exact = await parse_off_loop(content, _loads_reply)
                call.whole(reply)
                if sent.strip(reply):  # a long conversation's reply is serialised off the loop, as it was parsed
                    content = _dumps_reply(reply, exact) if len(content) <= PARSE_INLINE_BYTES else \
                        await asyncio.to_thread(_dumps_reply, reply, exact)
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                call.fail(502, f"the backend's reply is malformed: {type(e).__name__}: {e}")
            finally:
                call.end()
            return Response(content, upstream.status_code, headers=headers)

        async def relay():
            finished = False
            try:
                async for line in upstream.aiter_lines():
                    if finished or not line.startswith("data:"):  # after [DONE]: read to the end, for reuse
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        # The stream is whole: the record goes to the writer before the agent sees its end, so a
                        # client that leaves at [DONE] (as OpenAI's does) neither fails the call nor outruns its record.
                        finished = True
                        call.end()
                    else:
                        chunk, exact = _loads_reply(data)
                        if isinstance(chunk, dict) and chunk.get("error") is not None:
                            err = chunk["error"]
                            call.fail(int(err.get("code") or 500) if isinstance(err, dict) else 500, str(err))
                        elif isinstance(chunk, dict):
                            call.chunk(chunk)
                            if sent.strip(chunk):
                                data = _dumps_reply(chunk, exact).decode()
                    yield f"data: {data}\n\n"
                finished = True
            except (BackendError, ValueError, TypeError, AttributeError, KeyError) as e:
                if not finished:  # after [DONE] the record is whole, and the writer's
                    call.fail(502, f"the backend's stream failed: {type(e).__name__}: {e}")
                raise
            finally:  # also when the client goes away mid-stream
                if not finished and call.status < 400:
                    call.fail(499, "the client went away before the stream ended")
                await upstream.aclose()
                call.end()

        return StreamingResponse(relay(), upstream.status_code, headers=headers)

    async def send_chat(self, body: Any, request: Request, api: str = "chat.completions", *,
                        body_bytes: int | None = None) -> Sent:
        """Send a chat-completions (or completions) request to the least-loaded backend, served by the policy and
        asking for token ids and log-probs, with the call's record begun (`Sent.call`: the caller feeds it the
        reply and ends it). The backend's response is opened as a stream (the caller reads it, then `aclose()`s
        it, which also counts the request done). The `ChatSender` of gateway/responses.py. `body_bytes`: the size
        of the request as received, when known; a small one is serialised on the loop."""
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        asked = body.get("model")
        where = origin(request.headers, self.rollouts, request.scope.get("state", {}).get(ROLLOUT_KEY))
        try:
            served = self.serve_as(asked, where.component, where.trace_id)
            over_limit(body)
        except GatewayError as e:  # refused here: a failed call of its rollout all the same
            call = self.capture.begin(where, api, body, asked=str(asked)[:200], policy="")
            call.fail(e.status, e.message)
            call.end()
            raise
        # include_reasoning: with a reasoning parser, vLLM leaves a reply's token ids and log-probs out when asked
        # to leave its reasoning out; the record needs every sampled token, so the agent's choice is applied here.
        sent_body = {**body, "model": served, "return_token_ids": True, "logprobs": True, "include_reasoning": True}
        if api == "completions":
            sent_body["logprobs"] = max(1, body["logprobs"]) if type(body.get("logprobs")) is int else 1
        # Explicit, so that every backend samples with the settings the record (and the trainer) assume, never a
        # model's own generation defaults.
        for key in ("temperature", "top_p"):
            if sent_body.get(key) is None:
                sent_body[key] = 1.0
        if where.rollout is not None and where.rollout.phase == "train" and type(body.get("seed")) is int:
            # A fixed seed would make every rollout of a group the same sample: vary it per rollout.
            sent_body["seed"] = _vary(body["seed"], where.trace_id or "")
        elif where.rollout is not None and where.rollout.seed is not None and body.get("seed") is None:
            # An eval rollout: a seed of its own (evals.eval_seed) and the call's place in it, so the same policy
            # scores the same twice whatever the batch or the order. Training calls are never seeded here.
            sent_body["seed"] = (where.rollout.seed + next(where.rollout.calls)) % 2**63
        call = self.capture.begin(where, api, {k: v for k, v in sent_body.items() if k not in
                                               ("return_token_ids", "logprobs", "top_logprobs", "include_reasoning")},
                                  asked=asked, policy=served)
        # A long conversation is megabytes of JSON, serialised in a thread so as not to stall the loop; a small one on
        # the loop, as it was parsed: handing it to a thread and back costs more than the work, in wake-ups.
        content = _dumps(sent_body) if body_bytes is not None and body_bytes <= PARSE_INLINE_BYTES else \
            await asyncio.to_thread(_dumps, sent_body)
        backends = self.backends
        path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
        if self._client is None:
            # An idle connection is dropped before the backend's own keep-alive (uvicorn's and vLLM's: 5 s) can
            # close it under a request reusing it, which would fail that call.
            self._client = BackendClient(idle_s=BACKEND_IDLE_S)
        await self.door.enter()
        try:
            while True:
                i = backends.pick()
                try:
                    upstream = await self._client.post(f"{backends.urls[i]}{path}", content, self._backend_headers)
                except BackendError as e:
                    backends.done(i)
                    if isinstance(e, Refused) and backends.refused(i):
                        continue  # nothing reached that replica: another takes the call
                    message = f"the inference server at {backends.urls[i]} is unreachable ({type(e).__name__})"
                    call.fail(502, message)
                    call.end()
                    raise GatewayError(502, message)
                backends.reached(i)
                call.server = backends.urls[i]
                break
        except BaseException:
            self.door.leave()
            raise
        close, done = upstream.aclose, False

        async def aclose() -> None:
            nonlocal done
            try:
                await close()
            finally:
                if not done:
                    done = True
                    backends.done(i)
                    self.door.leave()

        upstream.aclose = aclose  # type: ignore[method-assign]  # in-flight counts end with the response
        asked = body.get("logprobs")  # chat: true; completions: how many alternatives (0 too)
        return Sent(upstream, call, logprobs=asked is not None and asked is not False,
                    token_ids=bool(body.get("return_token_ids")), reasoning=body.get("include_reasoning") is not False)


@dataclass
class Sent:
    """A request on its way: the backend's response (opened as a stream) and the call's record being made."""

    response: Upstream
    call: Call
    logprobs: bool  # the agent asked for log-probs
    token_ids: bool  # the agent asked for token ids (vLLM's `return_token_ids`)
    reasoning: bool = True  # the agent did not ask vLLM to leave the reasoning out (`include_reasoning: false`)

    def strip(self, reply: dict) -> bool:
        """Take off `reply` (a completion or a chunk) what the agent did not ask for; True if anything was."""
        changed = False
        if not self.token_ids and reply.pop("prompt_token_ids", None) is not None:
            changed = True
        for c in reply.get("choices") or ():
            if not isinstance(c, dict):
                continue
            if not self.token_ids and (c.pop("token_ids", None), c.pop("prompt_token_ids", None)) != (None, None):
                changed = True
            if not self.logprobs and c.get("logprobs") is not None:
                c["logprobs"] = None
                changed = True
            if not self.reasoning:
                for part in (c.get("message"), c.get("delta")):
                    if isinstance(part, dict):
                        changed |= any([part.pop(k, None) is not None for k in ("reasoning", "reasoning_content")])
        return changed


ROLLOUT_KEY = "lightning_rollout_key"
LLM_ROUTES = ("v1/chat/completions", "v1/completions", "v1/responses", "v1/models")  # what a rollout's URL reaches


class RolloutPath:
    """ASGI middleware: `/rollouts/{key}/v1/...` is `/v1/...` for the rollout whose key (its trace id) that is:
    the base URL a client without OpenTelemetry uses (docs/remote.md)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/rollouts/"):
            key, _, rest = scope["path"][len("/rollouts/"):].partition("/")
            if key and (rest in LLM_ROUTES or rest.startswith("v1/responses/")):
                scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode(),
                         "state": {**scope.get("state", {}), ROLLOUT_KEY: key}}
        await self.app(scope, receive, send)


async def _gateway_error(request: Request, e: GatewayError) -> JSONResponse:
    if e.status >= 500:
        log.warning("gateway: %s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
    return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)


async def _too_deep(request: Request, e: RecursionError) -> JSONResponse:
    # A body nested thousands deep parses (or not) into Python's recursion limit wherever it is walked: one line and
    # a 400, never a traceback per request.
    message = f"the request body is nested too deeply ({RecursionError.__name__}: {e})"
    log.warning("gateway: %s %s -> 400: %s", request.method, request.url.path, message)
    return JSONResponse(error_body(400, message), status_code=400)


class CallRoutes:
    """ASGI: a POST to one of `routes` (path -> handler: the routes every LLM call takes) is served here, its
    GatewayError and RecursionError answered as the app's exception handlers answer them; anything else goes to
    `app`. FastAPI's and Starlette's layers (error and telemetry middleware, the exit stack, matching every route)
    have nothing to do for these handlers and cost the loop ~30 us a call (benchmarks/README.md, issue 38). An
    exception of any other kind goes to uvicorn, which answers 500 and logs it, as the app's outer layer did."""

    def __init__(self, app: Any, routes: dict[str, Callable[[Request], Awaitable[Response]]]):
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send)
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except GatewayError as e:
            response = await _gateway_error(request, e)
        except RecursionError as e:
            response = await _too_deep(request, e)
        await response(scope, receive, send)


def over_limit(body: dict) -> None:
    """GatewayError 400 where the request's output constraint is over a size limit of constraint.py: refused here,
    before any backend (vLLM's compiler included) or the trainer's replay spends minutes compiling it."""
    try:
        c = from_request(body)
    except ConstraintError:  # malformed: the backend refuses it as it would anyway
        return
    if c is not None:
        try:
            check_size(c)
        except ConstraintError as e:
            raise GatewayError(400, str(e), e.param) from None


def _vary(seed: int, key: str) -> int:
    return (seed * 1_000_003 + int(key[:15] or "0", 16)) % (2**63)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


# A backend's replies are parsed and written back by orjson (a few times faster than the standard library, which
# the loop pays on every call); what orjson refuses to read (NaN, Infinity, a lone surrogate, a BOM) the standard
# library reads and writes back, as it did everything before. An integer past 64 bits, which no backend sends,
# orjson reads as a float.
def _loads_reply(raw: bytes | str) -> tuple[Any, bool]:
    """The parsed reply, and whether orjson parsed it (then orjson writes it back as it came)."""
    try:
        return orjson.loads(raw), True
    except orjson.JSONDecodeError:
        return json.loads(raw), False


def _dumps_reply(value: Any, exact: bool) -> bytes:
    if exact:
        try:
            return orjson.dumps(value)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes (254)
            pass
    return _dumps(value)


async def _json_body(request: Request) -> tuple[Any, int]:
    """The request's JSON body and its size in bytes."""
    raw = await request.body()
    try:
        return await parse_off_loop(raw, json.loads), len(raw)
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "the request body is not valid JSON") from None
    except RecursionError as e:
        log.warning("gateway: POST %s -> 400: the request body is nested too deeply", request.url.path)
        raise GatewayError(400, f"the request body is nested too deeply to parse ({e})") from None
