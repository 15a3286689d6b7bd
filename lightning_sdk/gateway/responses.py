"""The OpenAI Responses API (`POST /v1/responses`) served over any chat-completions backend, with exact token ids.

Agents that call the Responses API (the OpenAI Agents SDK given only a model name, newer OpenAI-client agents) are
served by the same backends as chat agents (the built-in server, vLLM): each request becomes one chat-completions
request that asks for token ids and log-probs, and the reply (or its SSE chunks) becomes a Response object (or the
Responses stream events). The token ids travel as three extra top-level fields of the Response, `prompt_token_ids`,
`output_token_ids` and `output_logprobs`, which `tracing/responses.py` copies onto the call's span.

Translated: `input` (text; messages with text parts; `function_call` / `function_call_output` items, which become
the assistant's `tool_calls` and `tool` messages with the same call ids; `reasoning` items are skipped),
`instructions` (a system message first), function `tools`, `tool_choice`, `parallel_tool_calls`, `temperature`,
`top_p`, `max_output_tokens`, `seed`, `user`, `stream`, and `previous_response_id` for responses this router made
(kept in memory, the latest `MAX_KEPT`, up to `MAX_KEPT_CHARS` characters of conversation, unless `store` is
false). What chat completions cannot serve faithfully is refused with a 400 naming the field, rather than ignored:
hosted tools, image/file/audio parts, `conversation`, `background`, stored `prompt`s. Structured output
(`text.format` json_schema or json_object) becomes chat's `response_format`. Other unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError

from lightning_sdk.console import printable
from lightning_sdk.gateway.capture import CALL_ID_HEADER, Call
from lightning_sdk.gateway.guard import INT64, GatewayError, Lenient, error_body, parse_off_loop, text_size
from lightning_sdk.gateway.upstream import BackendError, Upstream

log = logging.getLogger("lightning_sdk.servers")

ChatSender = Callable[[dict, Request, str], Awaitable[Any]]
"""Sends a chat-completions request body (for the agent's `Request`, through route `api`) to a backend; returns
`proxy.Sent`: the backend's response opened with `stream=True` (the caller reads it and calls `aclose()`) and the
call's record (`Sent.call`: fed the reply, then ended). May raise `GatewayError`."""

MAX_KEPT = 1024  # responses kept for previous_response_id and GET /v1/responses/{id}
MAX_KEPT_CHARS = 64_000_000  # characters of conversation they may hold together
# A backend's error names a chat field; the caller sent the Responses one.
_RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}
_TEXT_PARTS = ("input_text", "output_text", "text")


# ---- the request ----------------------------------------------------------------------------------------------

class ResponsesRequest(Lenient):
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)  # not OpenAI's, but vLLM's and the built-in server's
    # Asked for, and not servable over chat completions: refused rather than silently ignored.
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None


class _FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Message(Lenient):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCall(Lenient):
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class _FunctionCallOutput(Lenient):
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


def _param(data: Any, loc: tuple) -> str:
    """The path of a validation error in the request, without pydantic's union-member tags ('str', 'list[...]')."""
    out, node = [], data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (isinstance(node, dict) and i == len(loc) - 1):  # a missing field is named; a tag is not
            continue
        out.append(str(part))
    return ".".join(out)


def _validated(model: type[Lenient], data: Any, where: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        seen: dict[str, str] = {}
        for err in e.errors():
            seen.setdefault(".".join(filter(None, [where, _param(data, err["loc"])])), err["msg"])
        message = "; ".join(f"{p or 'body'}: {m}" for p, m in list(seen.items())[:5])
        raise GatewayError(400, message, next(iter(seen)) or None) from None


def _refused(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param)


# ---- Responses -> chat completions ----------------------------------------------------------------------------

@dataclass
class _Entry:
    """A kept response: the conversation its successor continues (its input and output as chat messages, without
    its instructions, which OpenAI does not carry over) and the Response object itself."""

    history: list[dict]
    chars: int
    response: dict


class _Kept:
    """The responses this router made, newest last, bounded in number and in characters of conversation."""

    def __init__(self, max_items: int = MAX_KEPT, max_chars: int = MAX_KEPT_CHARS):
        self.max_items, self.max_chars = max_items, max_chars
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # requests are translated in threads too

    def get(self, response_id: str) -> _Entry | None:
        with self._lock:
            return self._entries.get(response_id)

    def put(self, response_id: str, entry: _Entry) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._chars += entry.chars
            while self._entries and (len(self._entries) > self.max_items or self._chars > self.max_chars):
                _, old = self._entries.popitem(last=False)
                self._chars -= old.chars


@dataclass
class _Call:
    """One Responses request, translated."""

    request: ResponsesRequest
    chat: dict  # the chat-completions request body
    tools: list[dict]  # the function tools, as the Response object repeats them
    history: list[dict]  # previous conversation + this input, as chat messages (no instructions)
    history_chars: int
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))


def _content(content: str | list[dict], where: str) -> str | list[dict]:
    """Responses content parts -> chat content: one text part is a string, several stay parts."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if kind not in (*_TEXT_PARTS, "refusal"):
            raise _refused(f"{where}[{j}]: content part type {kind!r} is not supported: only text parts "
                           f"({', '.join(_TEXT_PARTS)}) can be served over chat completions", f"{where}.{j}.type")
        if not isinstance(text, str):
            raise _refused(f"{where}[{j}]: a {kind} part needs its text as a string", f"{where}.{j}")
        texts.append(text)
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts] if texts else ""


def _messages(items: str | list[dict] | None, where: str = "input") -> list[dict]:
    """Responses input items -> chat messages. Function calls join the assistant message before them (a reply with
    text and calls is one assistant turn, as the model sampled it); their outputs become tool messages."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            m = _validated(_Message, item, at)
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": _content(m.content, f"{at}.content")})
        elif kind == "function_call":
            c = _validated(_FunctionCall, item, at)
            call = {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            o = _validated(_FunctionCallOutput, item, at)
            out.append({"role": "tool", "tool_call_id": o.call_id, "content": _content(o.output, f"{at}.output")})
        elif kind == "reasoning":
            continue  # chat completions has no place for it; the model's reasoning, if any, is in its text
        else:
            raise _refused(f"{where}[{i}]: item type {kind!r} is not supported: only messages, function_call, "
                           f"function_call_output and reasoning items can be served over chat completions",
                           f"{at}.type")
    return out


def _chat_tools(tools: list[dict] | None) -> tuple[list[dict], list[dict]]:
    """Responses function tools -> (chat tools, the tools as the Response repeats them)."""
    chat, echo = [], []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise _refused(f"tools[{i}]: tool type {kind!r} is not supported: only function tools can be served "
                           f"over chat completions", f"tools.{i}.type")
        t = _validated(_FunctionTool, tool, f"tools.{i}")
        fn = {k: v for k, v in (("name", t.name), ("description", t.description), ("parameters", t.parameters),
                                ("strict", t.strict)) if v is not None}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", **fn})
    return chat, echo


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refused(f"tool_choice {choice!r} is not supported: 'none', 'auto', 'required' or "
                   f"{{'type': 'function', 'name': ...}}", "tool_choice")


def _chat_response_format(fmt: Any) -> dict | None:
    """Responses' `text.format` as chat's `response_format`: json_schema (its fields flat in Responses, under
    `json_schema` in chat) or json_object; both backends sample it under the grammar (lightning_sdk/constraint.py)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise _refused(f"text.format {kind!r} is not supported: expected 'text', 'json_object' or 'json_schema' with a "
                   f"schema", "text.format")


def _translate(raw: bytes, kept: _Kept) -> _Call:
    try:
        body = json.loads(raw)
    except ValueError:
        raise GatewayError(400, "the request body is not valid JSON") from None
    except RecursionError as e:
        raise GatewayError(400, f"the request body is nested too deeply to parse ({e})") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    req = _validated(ResponsesRequest, body)
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise _refused(f"{name} is not supported: this server keeps no conversations or stored prompts; send "
                           f"the input (or previous_response_id)", name)
    if req.background:
        raise _refused("background responses are not supported", "background")
    response_format = _chat_response_format((req.text or {}).get("format"))
    tools, echo_tools = _chat_tools(req.tools)
    tool_choice = _chat_tool_choice(req.tool_choice)
    previous = None
    if req.previous_response_id is not None:
        previous = kept.get(req.previous_response_id)
        if previous is None:
            raise _refused(f"previous_response_id {req.previous_response_id!r} is not a response this server kept "
                           f"(unknown, stored with store=false, or evicted)", "previous_response_id")
    new = _messages(req.input)
    history = (previous.history if previous else []) + new
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    if not messages:
        raise _refused("input is empty: give input, instructions or previous_response_id", "input")
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "n": 1, "logprobs": True,
                            "return_token_ids": True, "stream": bool(req.stream)}
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    for key, value in (("temperature", req.temperature), ("top_p", req.top_p), ("max_tokens", req.max_output_tokens),
                       ("tools", tools or None), ("tool_choice", tool_choice),
                       ("parallel_tool_calls", req.parallel_tool_calls), ("seed", req.seed), ("user", req.user),
                       ("response_format", response_format)):
        if value is not None:
            chat[key] = value
    chars = (previous.chars if previous else 0) + text_size(new)
    return _Call(request=req, chat=chat, tools=echo_tools, history=history, history_chars=chars)


# ---- chat completions -> Responses ----------------------------------------------------------------------------

def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


class _Reply:
    """A chat reply, fed whole or chunk by chunk, as Responses output items; yields the stream events it causes."""

    def __init__(self, call: _Call):
        self.call = call
        self.text = ""
        self.message_id: str | None = None
        self.calls: dict[int, dict] = {}  # chat tool-call index -> {id, call_id, name, arguments}
        self.order: list[str | int] = []  # output items by output_index: "message" or a chat tool-call index
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []
        self.logprobs: list[float] | None = []
        self.saw_ids = False
        self.model: str | None = None  # the name the backend answered as (the gateway's policy), once known

    # -- input

    def feed(self, chunk: dict) -> list[tuple[str, dict]]:
        """One chat.completion.chunk -> the stream events it causes."""
        if self.prompt_ids is None and chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        self.model = self.model or _name(chunk.get("model"))
        self.usage = chunk.get("usage") or self.usage
        events: list[tuple[str, dict]] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) == 0:
                events += self._choice(choice, choice.get("delta") or {})
        return events

    def whole(self, completion: dict) -> None:
        """A whole chat.completion (a plain request)."""
        self.prompt_ids = completion.get("prompt_token_ids")
        self.model = _name(completion.get("model"))
        self.usage = completion.get("usage")
        choice = next((c for c in completion.get("choices") or [] if c.get("index", 0) == 0), None)
        if choice is None:
            raise GatewayError(502, "the backend's chat completion has no choice")
        message = dict(choice.get("message") or {})
        message["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(message.get("tool_calls") or [])]
        self._choice(choice, message)
        self.close()  # the same items a stream ends with (an empty reply is an empty message)

    def _choice(self, choice: dict, delta: dict) -> list[tuple[str, dict]]:
        ids = choice.get("token_ids")
        if ids:
            self.saw_ids = True
            self.output_ids += ids
            content = (choice.get("logprobs") or {}).get("content")
            if self.logprobs is not None and content and len(content) == len(ids):
                self.logprobs += [float(t["logprob"]) for t in content]
            else:
                self.logprobs = None  # some tokens came without their log-probs: none are reported
        events = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for tc in delta.get("tool_calls") or []:
            events += self._tool_call(tc)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[tuple[str, dict]]:
        events = [] if self.message_id is not None else self._open_message()
        self.text += text
        return events + [("response.output_text.delta", {**self._where("message"), "content_index": 0,
                                                         "delta": text, "logprobs": []})]

    def _open_message(self) -> list[tuple[str, dict]]:
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.order.append("message")
        return [("response.output_item.added", {"output_index": len(self.order) - 1,
                                                "item": self._item("message", "in_progress")}),
                ("response.content_part.added", {**self._where("message"), "content_index": 0,
                                                 "part": _text_part("")})]

    def _tool_call(self, tc: dict) -> list[tuple[str, dict]]:
        index = tc.get("index", len(self.calls))
        fn = tc.get("function") or {}
        events = []
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = {"id": f"fc_{uuid.uuid4().hex}", "call_id": tc.get("id") or
                                        f"call_{uuid.uuid4().hex[:24]}", "name": fn.get("name") or "",
                                        "arguments": ""}
            self.order.append(index)
            events.append(("response.output_item.added", {"output_index": len(self.order) - 1,
                                                          "item": self._item(index, "in_progress")}))
        elif fn.get("name"):
            call["name"] += fn["name"]
        if fn.get("arguments"):
            call["arguments"] += fn["arguments"]
            events.append(("response.function_call_arguments.delta", {**self._where(index),
                                                                      "delta": fn["arguments"]}))
        return events

    # -- output

    def close(self) -> list[tuple[str, dict]]:
        """The events that finish every open item, in output order (after the last chunk)."""
        events = [] if self.order else self._open_message()  # no text and no call: an empty message
        for key in self.order:
            where = self._where(key)
            item = self._item(key, self._status(key))
            if key == "message":
                events += [("response.output_text.done", {**where, "content_index": 0, "text": self.text,
                                                          "logprobs": []}),
                           ("response.content_part.done", {**where, "content_index": 0,
                                                           "part": _text_part(self.text)})]
            else:
                events.append(("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                         "arguments": item["arguments"]}))
            events.append(("response.output_item.done", {"output_index": where["output_index"], "item": item}))
        return events

    def _where(self, key: str | int) -> dict:
        item_id = self.message_id if key == "message" else self.calls[key]["id"]
        return {"item_id": item_id, "output_index": self.order.index(key)}

    def _status(self, key: str | int) -> str:
        # A reply cut short was cut in its last item.
        return "incomplete" if self.truncated and key == self.order[-1] else "completed"

    def _item(self, key: str | int, status: str) -> dict:
        if key == "message":
            content = [] if status == "in_progress" else [_text_part(self.text)]
            return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                    "content": content}
        call = self.calls[key]
        return {"type": "function_call", "id": call["id"], "call_id": call["call_id"], "name": call["name"],
                "arguments": "" if status == "in_progress" else call["arguments"], "status": status}

    @property
    def truncated(self) -> bool:
        return self.finish_reason in ("length", "content_filter")

    def response(self, status: str | None = None) -> dict:
        """The Response object: in progress (`status` given, no output yet) or final, with the token ids."""
        req = self.call.request
        out: dict[str, Any] = {
            "id": self.call.response_id, "object": "response", "created_at": self.call.created_at,
            "status": status, "model": req.model, "output": [], "usage": None, "error": None,
            "incomplete_details": None, "instructions": req.instructions, "metadata": req.metadata or {},
            "tools": self.call.tools, "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "truncation": "disabled", "user": req.user, "store": req.store is not False,
        }
        if status is not None:
            return out
        out["status"] = "incomplete" if self.truncated else "completed"
        out["model"] = self.model or req.model  # as a chat completion's: the model that answered
        if self.truncated:
            reason = "max_output_tokens" if self.finish_reason == "length" else "content_filter"
            out["incomplete_details"] = {"reason": reason}
        out["output"] = [self._item(key, self._status(key)) for key in self.order]
        out["usage"] = self._usage()
        if self.prompt_ids is not None:
            out["prompt_token_ids"] = self.prompt_ids
        if self.saw_ids:
            out["output_token_ids"] = self.output_ids
            if self.logprobs is not None:
                out["output_logprobs"] = self.logprobs
        return out

    def _usage(self) -> dict:
        u = self.usage or {}
        prompt = u.get("prompt_tokens", len(self.prompt_ids or ()))
        completion = u.get("completion_tokens", len(self.output_ids))
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.get("total_tokens", prompt + completion)}

    def entry(self, response: dict) -> _Entry:
        """What a successor (previous_response_id) continues from: this input and output, as chat messages."""
        output = _messages(response["output"], "output")
        return _Entry(self.call.history + output, self.call.history_chars + text_size(output), response)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


# ---- the routes -----------------------------------------------------------------------------------------------

def _json(body: dict, status: int = 200) -> Response:
    # ASCII-escaped: a lone surrogate a backend echoes back in an error message cannot fail the encoding.
    return Response(json.dumps(body), status, media_type="application/json")


def _error(e: GatewayError) -> Response:
    return _json(error_body(e.status, e.message, e.param), e.status)


def _backend_error(status: int, content: bytes) -> Response:
    """A backend's own error, passed through with its status; the field it names becomes the Responses field."""
    try:
        body = json.loads(content)
        err = body["error"]
        if isinstance(err, dict) and isinstance(err.get("param"), str):
            head, _, rest = err["param"].partition(".")
            err["param"] = ".".join(filter(None, [_RESPONSES_PARAM.get(head, head), rest]))
        return _json(body, status)
    except (ValueError, KeyError, TypeError):
        return Response(content, status, media_type="application/json")


def responses_router(chat: ChatSender, *, max_kept: int = MAX_KEPT,
                     max_kept_chars: int = MAX_KEPT_CHARS) -> APIRouter:
    """`POST /v1/responses` (plain and streamed) and `GET /v1/responses/{id}`, served by sending chat-completions
    requests through `chat`."""
    router = APIRouter()
    kept = _Kept(max_kept, max_kept_chars)

    @router.post("/v1/responses")
    async def create(request: Request) -> Response:
        raw = await request.body()
        try:
            call = await parse_off_loop(raw, lambda body: _translate(body, kept))
            sent = await chat(call.chat, request, "responses")
        except GatewayError as e:
            log.warning("POST /v1/responses -> %d: %s", e.status, printable(e.message, 300))
            return _error(e)
        except BackendError as e:
            return _error(GatewayError(502, f"the backend is unreachable: {type(e).__name__}: {e}"))
        upstream, record = sent.response, sent.call
        record.response_id = call.response_id  # the id the app gets, so a reward can name the reply by it
        headers = {CALL_ID_HEADER: record.call_id}
        streamed = "text/event-stream" in upstream.headers.get("content-type", "")
        if upstream.status_code >= 400 or not streamed:
            try:
                content = await upstream.aread()
            except BackendError as e:
                record.fail(502, f"the backend's reply broke off: {type(e).__name__}")
                record.end()
                return _error(GatewayError(502, f"the backend's reply broke off: {type(e).__name__}: {e}"))
            finally:
                await upstream.aclose()
            if upstream.status_code >= 400:
                log.warning("POST /v1/responses -> %d from the backend", upstream.status_code)
                record.fail(upstream.status_code, content[:2000].decode("utf-8", "replace"))
                record.end()
                return _backend_error(upstream.status_code, content)
            if call.request.stream:
                record.fail(502, "the backend answered a streamed request without a stream")
                record.end()
                return _error(GatewayError(502, "the backend answered a streamed request without a stream"))
            try:
                response = _plain(call, content, kept, record)
            finally:
                record.end()
            response.headers.update(headers)
            return response
        if not call.request.stream:
            await upstream.aclose()
            record.fail(502, "the backend streamed its answer to a plain request")
            record.end()
            return _error(GatewayError(502, "the backend streamed its answer to a plain request"))
        return StreamingResponse(_stream(call, upstream, kept, record), media_type="text/event-stream",
                                 headers=headers)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        entry = kept.get(response_id)
        if entry is None:
            return _error(GatewayError(404, f"no response {response_id!r}: unknown, stored with store=false, or "
                                            f"evicted", "response_id"))
        return _json(entry.response)

    return router


def _plain(call: _Call, content: bytes, kept: _Kept, record: Call) -> Response:
    try:
        completion = json.loads(content)
        record.whole(completion)
        reply = _Reply(call)
        reply.whole(completion)
    except GatewayError as e:
        record.fail(e.status, e.message)
        return _error(e)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        record.fail(502, f"the backend's chat completion is malformed: {type(e).__name__}: {e}")
        return _error(GatewayError(502, f"the backend's chat completion is malformed: {type(e).__name__}: {e}"))
    response = reply.response()
    if call.request.store is not False:
        kept.put(call.response_id, reply.entry(response))
    return _json(response)


class _Events:
    """Responses stream events as SSE, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"


async def _stream(call: _Call, upstream: Upstream, kept: _Kept, record: Call) -> AsyncIterator[str]:
    """The backend's chat chunks -> response.created, response.in_progress, the items' events, then
    response.completed (or response.incomplete). A failure after the first byte is an `error` event, as OpenAI's."""
    event, reply, finished = _Events(), _Reply(call), False
    try:
        yield event("response.created", response=reply.response("in_progress"))
        yield event("response.in_progress", response=reply.response("in_progress"))
        async for line in upstream.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if isinstance(chunk, dict) and chunk.get("error") is not None:
                err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                record.fail(502, str(err.get("message") or "the backend failed"))
                param = err.get("param")
                yield event("error", code=str(err.get("code") or "server_error"),
                            message=str(err.get("message") or "the backend failed"),
                            param=_RESPONSES_PARAM.get(param, param) if isinstance(param, str) else None)
                return
            record.chunk(chunk)
            for kind, fields in reply.feed(chunk):
                yield event(kind, **fields)
        for kind, fields in reply.close():
            yield event(kind, **fields)
        response = reply.response()
        if call.request.store is not False:
            kept.put(call.response_id, reply.entry(response))
        yield event(f"response.{response['status']}", response=response)
        finished = True
    except (BackendError, ValueError, TypeError, AttributeError, KeyError) as e:
        log.warning("POST /v1/responses: the backend's stream failed: %s: %s", type(e).__name__, e)
        record.fail(502, f"the backend's stream failed: {type(e).__name__}: {e}")
        yield event("error", code="server_error", message=f"the backend's stream failed: {type(e).__name__}: {e}",
                    param=None)
    finally:
        if not finished and record.status < 400:
            record.fail(499, "the client went away before the stream ended")
        await upstream.aclose()
        record.end()
