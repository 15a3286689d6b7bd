"""The OpenAI-compatible HTTP surface of the engine, shaped like vLLM's OpenAI server.

Responses are OpenAI ChatCompletion objects plus vLLM's extra fields (`prompt_token_ids` at the top, `token_ids`
and `stop_reason` per choice), so the client side reads token ids the same way from either server. Errors have
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, which the openai client turns into its typed
exceptions (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import Field, ValidationInfo, field_validator

from lightning_sdk.constraint import OLD_VLLM_FIELDS, ConstraintError, from_request
from lightning_sdk.engine import toolcalls
from lightning_sdk.engine.engine import (
    MAX_TOP_LOGPROBS,
    ChoiceDelta,
    Engine,
    GenerationRequest,
    GenerationResult,
    ModelNotFound,
    RequestError,
)
from lightning_sdk.gateway.guard import INT64, MAX_BODY_BYTES, BodyLimit, KeyCheck, Lenient, error_body, text_size
from lightning_sdk.grammar import GrammarBusy

log = logging.getLogger("lightning_sdk.servers")

DEFAULT_MAX_TOKENS = 256


def _longest_token(tokenizer: Any) -> int:
    """The most characters one token stands for. Vocabulary strings are byte-level (GPT-2's Ġ) or pieces (▁), so
    their length is at least the characters they decode to: a prompt of more than max_model_len x this many
    characters cannot fit in max_model_len tokens, and need not be tokenised to know it."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class StreamOptions(Lenient):
    include_usage: bool = False


class Sampled(Lenient):
    """Request fields both APIs share beyond OpenAI's: a sampling setting this server applies (top_k, as vLLM), the
    output constraint (OpenAI's response_format, vLLM's structured_outputs: lightning_sdk/constraint.py), and vLLM's
    old names for the latter, refused by name rather than ignored (an agent would get unconstrained text)."""

    top_k: int | None = Field(None, ge=-1)  # -1 or 0: every token
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator(*OLD_VLLM_FIELDS)
    @classmethod
    def _old_name(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(f"{info.field_name} is vLLM's name before 0.12 (vLLM 0.32 ignores it): send "
                             f"structured_outputs {{\"{info.field_name.removeprefix('guided_')}\": ...}} instead")
        return v


class ChatCompletionRequest(Sampled):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extra
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "required" or a named function: enforced by a grammar (lightning_sdk/constraint.py)
    parallel_tool_calls: bool | None = None  # False: at most one call under a forced tool_choice
    return_token_ids: bool | None = None  # accepted; ids are always returned
    add_generation_prompt: bool = True  # vLLM extras for chat templates
    continue_final_message: bool = False
    # vLLM's request fields that put a caller's Jinja template (or arguments into ours) on the server: refused
    # (400), since rendering one is arbitrary work. The model's own template is what the trainer tokenises with.
    chat_template: Any = None
    chat_template_kwargs: Any = None
    skip_special_tokens: bool | None = None  # vLLM extra; unset: the model's tool format decides

    @field_validator("chat_template", "chat_template_kwargs")
    @classmethod
    def _no_caller_template(cls, v: Any, info: ValidationInfo) -> Any:
        # Only Qwen3's switch between thinking and not is taken (a boolean the template reads)
        if v is not None and not (info.field_name == "chat_template_kwargs" and isinstance(v, dict) and v
                                  and set(v) <= {"enable_thinking"} and all(isinstance(x, bool) for x in v.values())):
            raise ValueError(f"{info.field_name} is not accepted: this server renders the model's own chat template "
                             f"only (chat_template_kwargs: only {{'enable_thinking': true or false}})")
        return v


class CompletionRequest(Sampled):
    """The completions API (one prompt: text, or token ids), as OpenAI and vLLM take it."""

    model: str
    prompt: str | list[int] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    echo: bool = False
    return_token_ids: bool | None = None  # accepted; ids are always returned
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own prefix (BOS) before the prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v


class LoadLoraRequest(Lenient):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM: replace an adapter already loaded under this name


class UnloadLoraRequest(Lenient):
    lora_name: str = Field(min_length=1)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def create_app(engine: Engine, *, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    max_prompt_chars = engine.max_model_len * _longest_token(engine.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close()  # stop the generation thread before the interpreter tears torch down

    kwargs: dict[str, Any] = {"title": "lightning-sdk inference server", "lifespan": lifespan}
    try:
        # FastAPI 0.165 emits OTel spans into the global provider, where they would mix with the rollout spans.
        app = FastAPI(**kwargs, telemetry={"tracing": False})
    except TypeError:  # older FastAPI: no native telemetry to turn off
        app = FastAPI(**kwargs)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI and vLLM answer 400 (not FastAPI's 422), naming the field.
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            message, param = "the request body is not valid JSON", None
        else:
            first = errors[0] if errors else {}
            param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
            message = "; ".join(f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}"
                                for err in errors)
        log.warning("%s %s -> 400: %s", request.method, request.url.path, message)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods get the OpenAI error shape too, not Starlette's {"detail": ...}.
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, str(e) or type(e).__name__)

    v1 = APIRouter(prefix="/v1")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict:
        """Engine counters (requests, generate batches): how well concurrent requests were batched (key needed)."""
        return {**engine.stats, "adapters": engine.adapters, **engine.memory()}

    @v1.get("/models")
    async def list_models() -> dict:
        created = int(time.time())
        cards = [{"id": served_model_name, "object": "model", "created": created, "owned_by": "lightning-sdk",
                  "root": served_model_name, "parent": None, "max_model_len": engine.max_model_len}]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "lightning-sdk",
                   "root": name, "parent": served_model_name, "max_model_len": engine.max_model_len}
                  for name in engine.adapters]
        return {"object": "list", "data": cards}

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> JSONResponse:
        if body.lora_name == served_model_name:
            raise APIError(400, f"lora_name {body.lora_name!r} is the base model's served name", "lora_name")
        try:
            await engine.load_adapter(body.lora_name, body.lora_path, replace=body.load_inplace)
        except RequestError as e:
            raise APIError(400, str(e), e.param) from e
        return JSONResponse({"message": f"Success: LoRA adapter '{body.lora_name}' added successfully."})

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> JSONResponse:
        try:
            await engine.unload_adapter(body.lora_name)
        except ModelNotFound as e:
            raise APIError(404, str(e), "lora_name") from e
        return JSONResponse({"message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."})

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        try:
            parse_calls = toolcalls.check_tools(body.tools, body.tool_choice)
            body.messages = toolcalls.prompt_messages(body.messages)
        except toolcalls.ToolCallError as e:
            raise APIError(400, str(e), e.param) from e
        grammar = await _grammar(engine, {"response_format": body.response_format,
                                          "structured_outputs": body.structured_outputs, "tools": body.tools,
                                          "tool_choice": body.tool_choice,
                                          "parallel_tool_calls": body.parallel_tool_calls})
        req = await _to_generation_request(engine, body, served_model_name, max_prompt_chars)
        req.grammar = grammar
        reader = _reader(engine, body, parse_calls)
        # special tokens stay in the text where the format's markers are special tokens and the reply is read
        req.skip_special_tokens = body.skip_special_tokens if body.skip_special_tokens is not None else \
            reader.fmt is None or reader.fmt.skip_special_tokens
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            try:
                events = engine.stream(req)
                first = await anext(events)  # let errors found before the first token still be a plain HTTP error
            except (RequestError, ModelNotFound) as e:
                raise _as_api_error(e) from e
            shaper = toolcalls.StreamShaper(req.n, reader)
            return StreamingResponse(_sse(engine, body, req, meta, first, events, include_usage, shaper),
                                     media_type="text/event-stream")
        try:
            result = await engine.generate(req)
        except (RequestError, ModelNotFound) as e:
            raise _as_api_error(e) from e
        return _completion(engine, body, meta, result, reader)

    @v1.post("/completions")
    async def completions(body: CompletionRequest):
        if body.model != served_model_name and body.model not in engine.adapters:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model")
        if isinstance(body.prompt, str):
            if len(body.prompt) > max_prompt_chars:
                raise APIError(400, f"the prompt holds {len(body.prompt)} characters, more than this server's limit "
                                    f"of {max_prompt_chars}", "prompt")
            prompt_ids = await asyncio.to_thread(engine.encode_text, body.prompt,
                                                 add_special_tokens=body.add_special_tokens)
        else:
            prompt_ids = list(body.prompt)
            if any(i < 0 or i >= engine.vocab_size for i in prompt_ids):
                raise APIError(400, f"prompt: token ids must be in [0, {engine.vocab_size})", "prompt")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must not be empty", "stop")
        req = GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=body.max_tokens or 16,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, n=body.n, stop=stop,
            stop_token_ids=list(body.stop_token_ids or []), top_logprobs=body.logprobs or 0, seed=body.seed,
            adapter=None if body.model == served_model_name else body.model,
            grammar=await _grammar(engine, {"response_format": body.response_format,
                                            "structured_outputs": body.structured_outputs}))
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.model}
        if body.stream:
            try:
                events = engine.stream(req)
                first = await anext(events)
            except (RequestError, ModelNotFound) as e:
                raise _as_api_error(e) from e
            return StreamingResponse(_completion_sse(engine, body, req, meta, first, events),
                                     media_type="text/event-stream")
        try:
            result = await engine.generate(req)
        except (RequestError, ModelNotFound) as e:
            raise _as_api_error(e) from e
        return {**meta, "choices": [{
            "index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "logprobs": _text_logprobs(engine, body, c.token_ids, c.logprobs, c.top_logprobs),
            "token_ids": c.token_ids, "prompt_token_ids": result.prompt_ids,
        } for c in result.choices], "usage": _usage(result)}

    app.include_router(v1)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key is not None:
        app.add_middleware(KeyCheck, api_key=api_key)  # added last = runs first: before the body is even read
    return app


async def _grammar(engine: Engine, fields: dict[str, Any]) -> Any:
    """The request's output constraint compiled (on the grammar's own threads, never the default executor that
    every chat's encoding waits on), or None; a 400 naming the part that is malformed, over a limit or that the
    grammar engine cannot compile, a 503 while the compile threads are busy."""
    try:
        constraint = from_request(fields)
        return None if constraint is None else await engine.compile(constraint)
    except GrammarBusy as e:
        raise APIError(503, str(e), e.param) from e
    except ConstraintError as e:
        raise APIError(400, str(e), e.param) from e


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, ModelNotFound):
        return APIError(404, str(e), "model")
    return APIError(400, str(e), getattr(e, "param", None))


async def _to_generation_request(engine: Engine, body: ChatCompletionRequest, served_model_name: str,
                                 max_prompt_chars: int) -> GenerationRequest:
    if body.model != served_model_name and body.model not in engine.adapters:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    size = text_size(body.messages) + text_size(body.tools)
    if size > max_prompt_chars:  # before tokenising: a 15 MB message must not cost seconds and gigabytes first
        raise APIError(400, f"messages and tools hold {size} characters, more than this server's limit of "
                            f"{max_prompt_chars} (max_model_len {engine.max_model_len} x the longest token's "
                            f"{max_prompt_chars // engine.max_model_len} characters): the prompt cannot fit",
                       "messages")
    try:
        # Template rendering and tokenising take a thread, so /health and other requests are answered meanwhile.
        prompt_ids = await asyncio.to_thread(engine.encode_chat, body.messages, tools=body.tools,
                                             add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             template_kwargs=body.chat_template_kwargs)
    except RequestError as e:
        raise APIError(400, str(e), e.param) from e
    requested = body.max_completion_tokens or body.max_tokens
    room = engine.max_model_len - len(prompt_ids)
    if requested is None and room < 1:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, which leaves no room for a reply within "
                            f"max_model_len {engine.max_model_len}", "messages")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", "stop")
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_tokens=requested if requested is not None else min(DEFAULT_MAX_TOKENS, room),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        n=body.n,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        seed=body.seed,
        adapter=None if body.model == served_model_name else body.model,
    )


def _logprob(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


def _logprob_entry(engine: Engine, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict:
    token = engine.token_text(token_id)
    return {
        "token": token,
        "logprob": _logprob(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
        "top_logprobs": [{"token": (t := engine.token_text(i)), "logprob": _logprob(lp),
                          "bytes": list(t.encode("utf-8", errors="replace"))} for i, lp in (top or [])],
    }


def _logprobs(engine: Engine, body: ChatCompletionRequest, ids: list[int], lps: list[float],
              top: list[list[tuple[int, float]]] | None) -> dict | None:
    if not body.logprobs:
        return None
    return {"content": [_logprob_entry(engine, i, lp, top[k] if top else None)
                        for k, (i, lp) in enumerate(zip(ids, lps))]}


def _usage(result: GenerationResult) -> dict:
    completion = sum(len(c.token_ids) for c in result.choices)
    prompt = len(result.prompt_ids)
    # prompt_tokens_details as OpenAI sends it: the OpenAI instrumentor raises (and formats a traceback, ~0.4 ms)
    # on every call without it.
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _reader(engine: Engine, body: ChatCompletionRequest, parse_calls: bool) -> toolcalls.Reader:
    """How this request's replies are read: the model's tool format (when calls are parsed; gpt-oss's always, its
    channels hold the reasoning, but without its calls when none are parsed), its reasoning split, the forced
    choice."""
    fmt = toolcalls.tool_format(engine.tool_parser)
    thinking = None
    if engine.reasoning_parser == "qwen3":  # vLLM's split, off with Qwen3's enable_thinking false
        thinking = toolcalls.Thinking(closed=(body.chat_template_kwargs or {}).get("enable_thinking") is False)
    return toolcalls.Reader(fmt if parse_calls else fmt.without_calls(), thinking,
                            toolcalls.forced_choice(body.tool_choice) if parse_calls else None)


def _completion(engine: Engine, body: ChatCompletionRequest, meta: dict, result: GenerationResult,
                reader: toolcalls.Reader) -> dict:
    shaped = [toolcalls.message(c.text, c.finish_reason, reader) for c in result.choices]
    return {
        **meta,
        "object": "chat.completion",
        "system_fingerprint": None,
        "choices": [{
            "index": c.index,
            "message": message,
            "logprobs": _logprobs(engine, body, c.token_ids, c.logprobs, c.top_logprobs),
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": c.token_ids,
        } for c, (message, finish_reason) in zip(result.choices, shaped)],
        "usage": _usage(result),
        "prompt_token_ids": result.prompt_ids,
    }


def _text_logprobs(engine: Engine, body: CompletionRequest, ids: list[int], lps: list[float],
                   top: list[list[tuple[int, float]]] | None) -> dict | None:
    """The completions API's log-probs (its legacy shape: parallel lists)."""
    if body.logprobs is None:
        return None
    return {"tokens": [engine.token_text(i) for i in ids], "token_logprobs": [_logprob(x) for x in lps],
            "top_logprobs": [{engine.token_text(i): _logprob(lp) for i, lp in (top[k] if top else [])}
                             for k in range(len(ids))], "text_offset": []}


async def _completion_sse(engine: Engine, body: CompletionRequest, req: GenerationRequest, meta: dict,
                          first: ChoiceDelta | GenerationResult, events: AsyncIterator) -> AsyncIterator[str]:
    def chunk(choice: dict, **extra: Any) -> str:
        return f"data: {json.dumps({**meta, 'choices': [choice], **extra})}\n\n"

    prompt_sent = []  # the first chunk carries the prompt's ids

    def delta(d: ChoiceDelta) -> str:
        extra = {} if prompt_sent else {"prompt_token_ids": req.prompt_ids}
        prompt_sent.append(True)
        return chunk({"index": d.index, "text": d.text, "finish_reason": d.finish_reason, "stop_reason": d.stop_reason,
                      "token_ids": d.token_ids,
                      "logprobs": _text_logprobs(engine, body, d.token_ids, d.logprobs, d.top_logprobs)}, **extra)

    def usage(result: GenerationResult) -> list[str]:
        include = body.stream_options and body.stream_options.include_usage
        return [f"data: {json.dumps({**meta, 'choices': [], 'usage': _usage(result)})}\n\n"] if include else []

    async for line in _events(first, events, delta, usage):
        yield line


async def _sse(engine: Engine, body: ChatCompletionRequest, req: GenerationRequest, meta: dict,
               first: ChoiceDelta | GenerationResult, events: AsyncIterator, include_usage: bool,
               shaper: toolcalls.StreamShaper) -> AsyncIterator[str]:
    def chunk(choices: list[dict], **extra: Any) -> str:
        return f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    def delta(d: ChoiceDelta) -> str:
        message, finish_reason = shaper.delta(d.index, d.text, d.finish_reason)
        return chunk([{"index": d.index, "delta": message,
                       "logprobs": _logprobs(engine, body, d.token_ids, d.logprobs, d.top_logprobs),
                       "finish_reason": finish_reason, "stop_reason": d.stop_reason, "token_ids": d.token_ids}])

    # The role comes first, one chunk per choice, as OpenAI does; the first also carries the prompt ids.
    for index in range(req.n):
        extra = {"prompt_token_ids": req.prompt_ids} if index == 0 else {}
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None, "token_ids": []}], **extra)
    async for line in _events(first, events, delta, lambda result: [chunk([], usage=_usage(result))]
                              if include_usage else []):
        yield line


async def _events(first: ChoiceDelta | GenerationResult, events: AsyncIterator,
                  delta: Callable[[ChoiceDelta], str], tail: Callable[[GenerationResult], list[str]]
                  ) -> AsyncIterator[str]:
    """A stream's SSE lines: one per delta, then `tail` of the final result, then [DONE]. The status line is already
    sent when an error comes: it is reported in the stream, as vLLM does."""
    try:
        item = first
        while not isinstance(item, GenerationResult):
            yield delta(item)
            item = await anext(events)
        for line in tail(item):
            yield line
    except (RequestError, ModelNotFound, RuntimeError) as e:
        status = 404 if isinstance(e, ModelNotFound) else 400 if isinstance(e, RequestError) else 500
        yield f"data: {json.dumps(error_body(status, str(e)))}\n\n"
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"
