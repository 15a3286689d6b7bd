"""The dashboard's web server: a JSON API over `RunReader`, one static page, and the key every request needs.

Security, because the page shows what agents and models wrote:
- a token per start (printed in the URL); `?token=` sets a cookie and is then dropped from the address bar;
  requests with neither are refused (401);
- GET only: nothing here writes, and every store is opened read-only (`store=` names a file of the run's evals/
  only by a name in that folder's listing);
- a strict Content-Security-Policy (scripts and styles from this server only, no inline script, no eval), and
  the page puts agent text into the document with `textContent`, never as markup.
Every endpoint is a plain `def`, so FastAPI runs it in its thread pool: a slow query on a big store does not
block the event loop.
"""

from __future__ import annotations

import json
import math
import secrets
import socket
import unicodedata
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlencode

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from lightning_sdk.dashboard.runs import MAX_PAGE, STATUSES, RunNotFound, RunReader
from lightning_sdk.gateway.guard import DEFAULT_HEADER_TIMEOUT, guarded_protocol
from lightning_sdk.store import ROLLOUT_SORTS

STATIC = Path(__file__).parent / "static"
SQLITE_MAX = 2**63 - 1  # SQLite's largest integer: a bigger offset or iteration is bad input, not a 500
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",  # the token must not leave in a Referer header
    "Cache-Control": "no-store",
}


class JSON(Response):
    """JSON where a NaN or inf (a diverged loss in metrics.jsonl) becomes null instead of failing the request."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), separators=(",", ":")).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def control_character_in(request: Request) -> str | None:
    """One line naming the query parameter (or the path) that holds a control character, else None. No run, rollout
    or filter value has one, and a NUL would fail deep inside (a path, SQLite) as a 500 instead."""
    for key, value in request.query_params.multi_items():
        for what, text in ((f"query parameter {key!r}", value), ("a query parameter's name", key)):
            if any(unicodedata.category(c) == "Cc" for c in text):
                return f"{what}: holds a control character; expected plain text"
    if any(unicodedata.category(c) == "Cc" for c in request.scope["path"]):  # decoded: %00 is a NUL here
        return "the path holds a control character"
    return None


def same_origin(path: str) -> str:
    """`path` as a redirect target on this server: `//host/x` (and `/\\host/x`, which browsers read the same way) would
    send the browser to another site, so leading slashes collapse to one and the rest is percent-encoded."""
    return "/" + quote(path.lstrip("/\\"), safe="/")


def create_app(reader: RunReader, token: str, cookie: str) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, default_response_class=JSON,
                  telemetry={"tracing": False})  # FastAPI's own spans would land in a traced process's store

    @app.middleware("http")
    async def guard(request: Request, call_next):
        given = request.query_params.get("token")
        if given is not None and secrets.compare_digest(given, token):
            if (bad := control_character_in(request)) is not None:
                response: Response = PlainTextResponse(bad, 400)
            else:  # drop the token from the address bar (and history); the cookie carries it from now on
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                response = RedirectResponse(same_origin(request.scope["path"]) + ("?" + urlencode(rest) if rest else ""),
                                            303)
                response.set_cookie(cookie, token, httponly=True, samesite="strict", path="/")
        elif secrets.compare_digest(request.cookies.get(cookie, ""), token):
            if (bad := control_character_in(request)) is not None:
                response = PlainTextResponse(bad, 400)
            elif request.method not in ("GET", "HEAD"):
                response = PlainTextResponse("the dashboard is read-only", 405)
            else:
                response = await call_next(request)
        else:
            response = PlainTextResponse("missing or wrong token: open the URL `lightning dashboard` printed", 401)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.exception_handler(RequestValidationError)
    def _bad_query(request: Request, e: RequestValidationError) -> PlainTextResponse:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "the request"
        return PlainTextResponse(f"{where}: {first['msg']}", 400)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def found(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RunNotFound as e:
            raise HTTPException(404, str(e)) from None

    @app.get("/api/runs")
    def runs() -> Any:
        return {"root": str(reader.root), "runs": reader.runs()}

    @app.get("/api/summary")
    def summary(run: str) -> Any:
        return found(reader.summary, run)

    @app.get("/api/rollouts")
    def rollouts(run: str, status: Literal[STATUSES] | None = None,  # type: ignore[valid-type]
                 phase: Literal["train", "eval"] | None = None, component: str | None = None,
                 min_reward: float | None = None, max_reward: float | None = None,
                 iteration: int | None = Query(None, ge=0, le=SQLITE_MAX), q: str | None = Query(None, max_length=500),
                 sort: Literal[tuple(ROLLOUT_SORTS)] = "started",  # type: ignore[valid-type]
                 desc: bool = True, offset: int = Query(0, ge=0, le=SQLITE_MAX), limit: int = Query(50, ge=1, le=MAX_PAGE),
                 store: str | None = None) -> Any:
        return found(reader.rollouts, run, status=status, phase=phase, component=component or None,
                     min_reward=min_reward, max_reward=max_reward, iteration=iteration, search=q or None, sort=sort,
                     descending=desc, offset=offset, limit=limit, store=store or None)

    # store: a file of the run's evals/ by name, checked against that folder's listing (RunReader.store_file)
    @app.get("/api/rollout")
    def rollout(run: str, id: str, store: str | None = None) -> Any:  # noqa: A002 - the query parameter's name
        view = found(reader.rollout, run, id, store or None)
        if view is None:
            raise HTTPException(404, f"no rollout {id!r} in run {run!r}")
        return view

    return app


def serve(reader: RunReader, sock: socket.socket, token: str, *,
          header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> None:
    import uvicorn

    port = sock.getsockname()[1]
    app = create_app(reader, token, cookie=f"lightning_dashboard_{port}")  # cookies are per host, not per port
    # The gateway's guard: a connection that never completes its headers is closed after `header_timeout`.
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                  http=guarded_protocol(header_timeout=header_timeout))).run(sockets=[sock])


def new_token() -> str:
    return secrets.token_urlsafe(24)
