"""The remote runtime's HTTP routes, added to the run's gateway (same address; the workers' own key, which the
agents' key is not): workers claim rollouts, send their spans over OTLP/HTTP and report results. A claim's spans
and result are taken only with its secret. The table of routes and bodies: docs/remote.md.

Untrusted bodies are read up to a limit, and decoded (OTLP protobuf/JSON, pydantic) and stored in threads: the
gateway's event loop, which also relays the agents' LLM calls, never waits on them.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from lightning_sdk.rollouts.remote import protocol
from lightning_sdk.rollouts.remote.dispatch import Dispatch, Forbidden
from lightning_sdk.rollouts.remote.protocol import Claim, ClaimRequest, Endpoint, Result, RunInfo
from lightning_sdk.console import printable
from lightning_sdk.gateway.guard import MAX_BODY_BYTES, PerSourceLog, error_body, parse_off_loop
from lightning_sdk.rollouts.remote import otlp

log = logging.getLogger("lightning_sdk")



class _TooLarge(Exception):
    pass


def work_router(dispatch: Dispatch, *, run_name: str, api_key: str, redirect_openai: bool,
                long_poll_s: float = protocol.LONG_POLL_S, max_body_bytes: int = MAX_BODY_BYTES) -> APIRouter:
    """The routes; `api_key` is the key agents use for LLM calls (the gateway's), handed to workers."""
    router = APIRouter()
    # A worker key can send results for rollouts it does not hold as fast as it likes: logged per source a minute.
    foreign = PerSourceLog("result for {rollout} from {source} refused: the sender does not hold its claim; further "
                           "such results from it are counted, one line a minute",
                           "{n} more result(s) from {source} refused in the last {window:.0f}s: the sender does not "
                           "hold their claim")
    unclaimed = PerSourceLog("result for {rollout} from {source} (worker {worker}) ignored: not claimed now; further "
                             "such results from it are counted, one line a minute",
                             "{n} more result(s) from {source} ignored in the last {window:.0f}s: their rollouts are "
                             "not claimed now")

    def summarised(lines: PerSourceLog, request: Request, **words: object) -> None:
        if lines.note((request.client or ("unknown",))[0], **words):
            lines.flush_later()

    @router.get(protocol.RUN)
    async def run() -> dict:
        dispatch.touch(None)
        return RunInfo(name=run_name, phase=dispatch.label, over=dispatch.over, redirect_openai=redirect_openai,
                       api_key=api_key).model_dump()

    @router.post(protocol.CLAIM)
    async def claim(request: Request) -> Response:
        body = await _parse(request, ClaimRequest, max_body_bytes)
        if isinstance(body, Response):
            return body
        claimed = await dispatch.claim(body.worker, long_poll_s, request.is_disconnected)
        if claimed is None:
            if dispatch.over:
                dispatch.mark_told(body.worker)
                return JSONResponse(error_body(410, f"run {run_name!r} is over"), status_code=410)
            return Response(status_code=204)
        job = claimed.job
        log.debug("%s claimed %s", printable(body.worker), printable(job.rollout_id))
        root = str(request.base_url).rstrip("/")  # the address this worker reached us at: right on other machines
        return JSONResponse(Claim(
            rollout_id=job.rollout_id, task_id=job.task_id, group_id=job.group_id, task=job.task,
            iteration=job.iteration, phase=job.phase, attempt=job.attempt, timeout=dispatch.timeout,
            deadline_s=max(0.0, claimed.deadline - dispatch.clock()),
            # The rollout's URL holds its claim's secret: only the claim holder's calls train under it.
            llm=Endpoint(base_url=f"{root}/rollouts/{job.trace_id}.{claimed.secret}/v1", api_key=api_key,
                         model=dispatch.policy or ""),
            trace_id=job.trace_id, secret=claimed.secret, span_id=claimed.span_id,
        ).model_dump(mode="json"))

    @router.post(protocol.RESULT)
    async def result(rollout_id: str, request: Request) -> Response:
        secret = request.headers.get(protocol.CLAIM_HEADER)
        body = await _parse(request, Result, max_body_bytes)
        try:
            if isinstance(body, Response):
                # A rollout whose holder reports it with a malformed result (a NaN or string reward...) fails, with
                # the line that says why; the worker hears the same line (4xx). From anyone else: only the 4xx.
                if body.status_code == 400 and dispatch.holds(rollout_id, secret):
                    await asyncio.to_thread(dispatch.finish, rollout_id, _message(body), secret)
                return body
            finished = await asyncio.to_thread(dispatch.finish, rollout_id, body, secret)
        except Forbidden:
            summarised(foreign, request, rollout=repr(rollout_id))
            return JSONResponse(error_body(403, f"rollout {rollout_id[:200]!r} is claimed by another worker: only "
                                                f"its claim's secret ({protocol.CLAIM_HEADER}) can report it"),
                                status_code=403)
        if finished is None:
            summarised(unclaimed, request, rollout=repr(rollout_id), worker=body.worker)
            return JSONResponse(error_body(409, f"rollout {rollout_id[:200]!r} is not claimed now (unknown, already "
                                                f"finished, or abandoned at its deadline and re-run under another "
                                                f"id): this result is ignored"), status_code=409)
        return JSONResponse({"accepted": True})

    @router.post(protocol.TRACES)
    async def traces(request: Request) -> Response:
        dispatch.touch(None)
        kind = otlp.JSON
        try:
            kind = otlp.media_type(request.headers.get("content-type"))
            raw = await _read(request, max_body_bytes)
            decoded = await asyncio.to_thread(otlp.decode, raw, content_type=kind, limit=max_body_bytes,
                                              content_encoding=request.headers.get("content-encoding"))
        except _TooLarge:
            return _otlp_error(413, f"the body is larger than the limit of {max_body_bytes} bytes", kind)
        except otlp.OtlpError as e:
            return _otlp_error(e.status, str(e), kind)
        spans = await asyncio.to_thread(dispatch.take_spans, decoded)
        if spans.forbidden is not None:
            return _otlp_error(403, spans.forbidden, kind)
        if spans.rejected:
            log.info("OTLP export: %d span(s) stored, refused %s", spans.stored, spans.message())
        return Response(otlp.response(spans.rejected, spans.message(), kind=kind), media_type=kind)

    return router


def _message(response: Response) -> str:
    """The one line of a 4xx answer made by `_parse`."""
    return json.loads(response.body)["error"]["message"]


def _otlp_error(status: int, message: str, kind: str) -> Response:
    log.warning("POST %s -> %d: %s", protocol.TRACES, status, printable(message, 300))
    return Response(otlp.error(message, kind=kind), status_code=status, media_type=kind)


async def _read(request: Request, limit: int) -> bytes:
    """The body, refused (_TooLarge) as soon as it passes `limit` bytes, whatever Content-Length claims."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[BaseModel], limit: int) -> BaseModel | Response:
    """The JSON body as `model`, or the 4xx answer: 413 over the limit, 400 naming the first bad field."""
    try:
        raw = await _read(request, limit)
    except _TooLarge:
        return JSONResponse(error_body(413, f"the request body is larger than the limit of {limit} bytes"),
                            status_code=413)
    try:
        return await parse_off_loop(raw, model.model_validate_json)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        return JSONResponse(error_body(400, f"{field}: {message}" if field else message, field or None),
                            status_code=400)
