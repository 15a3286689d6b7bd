"""`POST /v1/feedback`: the app's rewards, on the gateway's address and behind its key (ledger.py says what is
accepted). The route is a plain function: FastAPI runs it on its thread pool, so the SQLite write never blocks
the event loop that relays calls."""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from lightning_sdk.gateway.guard import error_body
from lightning_sdk.production.ledger import FeedbackError, FeedbackLedger

MAX_FEEDBACK_BYTES = 64 * 1024


def feedback_router(ledger: FeedbackLedger, flush: Callable[[], Any]) -> APIRouter:
    """The route; `flush()` waits until every call answered so far is in the store, so feedback sent right after
    a reply finds its call."""
    router = APIRouter()

    async def read(request: Request) -> JSONResponse:
        raw = await request.body()
        if len(raw) > MAX_FEEDBACK_BYTES:
            return _refuse(FeedbackError(413, "body", f"expected at most {MAX_FEEDBACK_BYTES} bytes"))
        try:
            body = json.loads(raw)
        except ValueError:
            return _refuse(FeedbackError(422, "body", "expected a JSON object"))
        return await run_in_threadpool(record, body)

    def record(body: Any) -> JSONResponse:
        flush()
        try:
            done = ledger.give(body)
        except FeedbackError as e:
            return _refuse(e)
        return JSONResponse({"feedback_id": done.feedback_id, "duplicate": done.duplicate, "calls": done.calls})

    router.add_api_route("/v1/feedback", read, methods=["POST"])
    return router


def _refuse(e: FeedbackError) -> JSONResponse:
    return JSONResponse(error_body(e.status, f"{e.field}: {e.message}", e.field), status_code=e.status)
