"""The training record of every LLM call the gateway serves, made where the truth is: from the request it received
and the reply the backend produced (exact prompt and completion token ids, log-probs, the adapter that served it).

A record is the call's server-side span, with `gen_ai.*` attributes and our `lightning.llm.*` ones, stored with
`source = "gateway"` (tracing/records.py). Which rollout a call belongs to comes from the request's W3C
`traceparent` (the rollout's trace id, opened here by the runtime before the rollout runs) or from the per-rollout
base URL (`/rollouts/{key}/v1`) for clients without OpenTelemetry; its component from `baggage`. A call with
neither is recorded as a call of no rollout: counted, never trained. The record's span id goes back to the agent
in the `x-lightning-call-id` header, so that rewards and failed tools are ordered after the calls the agent had
seen (tracing/propagation.py), whatever the clocks of the agent's machine say.

Routes hand each call's request and reply to a `Call`; building the record and writing it happen on one writer
thread, off the event loop that relays the calls.
"""

from __future__ import annotations

import functools
import hmac
import itertools
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import urlsplit

from opentelemetry import baggage, trace
from opentelemetry.context import Context

from lightning_sdk.constraint import ConstraintError, ServerGrammar, from_request
from lightning_sdk.drain import Drain
from lightning_sdk.tracing.context import COMPONENT_KEY, PROPAGATOR, ROLLOUT_KEY
from lightning_sdk.tracing.propagation import CALL_ID_HEADER, CLAIM_HEADER
from lightning_sdk.tracing.records import (API, ATTEMPT, COMPLETION_IDS, COMPLETION_LOGPROBS, COMPLETION_TOKENS,
                                           COMPONENT, CONSTRAINT, GATEWAY, POLICY, PROMPT_IDS, ROLLOUT_ID, TEXT,
                                           TEXT_NOT_STORED, UNREPRODUCIBLE, CallSink, SpanRecord)

__all__ = ["CALL_ID_HEADER", "Call", "Capture", "OpenRollouts", "Origin", "RecordOutlet", "Rollout", "origin",
           "unreproducible"]

# What a record without text (serve.store_text = false) leaves out: the app's and the model's words. Training reads
# none of them (the token ids, log-probs, constraint and sampling settings stay).
TEXT_ATTRIBUTES = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.definitions", COMPLETION_TOKENS)

MAX_OPEN = 100_000  # open rollouts remembered: a runtime that forgot to close some cannot grow this forever

# Request fields that change the sampled distribution in ways the trainer's log-probs do not reproduce (it applies
# temperature, top_p and the output constraint, lightning_sdk/constraint.py). A call that sets one is served and
# recorded, and left out of training, by name. guided_*: vLLM's old names, which vLLM 0.32 ignores.
UNREPRODUCIBLE_SETTINGS = ("top_k", "min_p", "typical_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids",
                           "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                           "use_beam_search", "best_of")
_NEUTRAL = {"top_k": (0, -1), "min_p": (0, 0.0), "typical_p": (1, 1.0), "presence_penalty": (0, 0.0),
            "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "min_tokens": (0,), "best_of": (1,),
            "use_beam_search": (False,)}


_UNSET = {k: (None, [], {}, *_NEUTRAL.get(k, ())) for k in UNREPRODUCIBLE_SETTINGS}  # values that change nothing


def unreproducible(body: Mapping[str, Any]) -> list[str]:
    """The sampling settings of a chat/completions request body the trainer cannot reproduce."""
    return [k for k, unset in _UNSET.items() if body.get(k) not in unset]


@dataclass(frozen=True)
class Rollout:
    """A rollout the gateway attributes calls to."""

    rollout_id: str
    attempt: int
    phase: str  # 'train' | 'eval'
    seed: int | None = None  # an eval rollout's: its calls that set no seed sample with one made from it
    calls: Iterator[int] = field(default_factory=itertools.count, compare=False)  # numbers its calls 0, 1, ...
    # A `lightning worker`'s rollout: its claim's secret, which a call must carry (CLAIM_HEADER, or the per-rollout
    # URL) to be attributed to it. A trace id is no key: it is in every span exported.
    secret: str | None = field(default=None, compare=False, repr=False)

    def admits(self, secret: str | None) -> bool:
        return self.secret is None or (secret is not None and hmac.compare_digest(secret.encode(),
                                                                                   self.secret.encode()))


class OpenRollouts:
    """The rollouts running now, by key: the rollout's trace id (32 hex digits), which also names its per-rollout
    base URL. The runtime opens one before its agent runs and closes it after; thread-safe."""

    def __init__(self) -> None:
        self._open: dict[str, Rollout] = {}
        self._lock = threading.Lock()

    def open(self, key: str, rollout_id: str, attempt: int = 1, phase: str = "train", *,
             seed: int | None = None, secret: str | None = None) -> None:
        with self._lock:
            if len(self._open) >= MAX_OPEN:
                self._open.pop(next(iter(self._open)))
            self._open[key] = Rollout(rollout_id, attempt, phase, seed, secret=secret)

    def close(self, key: str) -> None:
        with self._lock:
            self._open.pop(key, None)

    def get(self, key: str | None) -> Rollout | None:
        return self._open.get(key) if key else None


@dataclass(frozen=True)
class Origin:
    """Where a call came from: its rollout (None: unknown), trace and parent span, component."""

    rollout: Rollout | None
    trace_id: str | None
    parent_id: str | None
    component: str | None


def origin(headers: Mapping[str, str], rollouts: OpenRollouts, key: str | None = None) -> Origin:
    """The call's origin from its W3C headers, or from the per-rollout URL's `key` (which wins): `TRACE_ID`, or
    `TRACE_ID.SECRET` for a worker's rollout. A worker's rollout takes only calls that carry its claim's secret
    (in the URL, or the CLAIM_HEADER its propagation adds); any other call naming it is recorded as a call of no
    rollout."""
    w3c = tuple(headers.get(name) for name in W3C_HEADERS)
    trace_id, parent_id, comp, named = (_w3c if sum(len(v) for v in w3c if v) > _CACHED_W3C_CHARS else
                                        _w3c_cached)(*w3c)
    secret = headers.get(CLAIM_HEADER)
    if key is not None:
        key, dot, in_url = key.partition(".")
        rollout = rollouts.get(key)
        rollout = rollout if rollout is not None and rollout.admits(in_url if dot else secret) else None
        return Origin(rollout, key, parent_id if trace_id == key else None, comp)
    rollout = rollouts.get(trace_id)
    if rollout is None:  # under a span that started a trace of its own: the rollout's baggage entry still says
        rollout = rollouts.get(named)
    return Origin(rollout if rollout is not None and rollout.admits(secret) else None, trace_id, parent_id, comp)


W3C_HEADERS = ("traceparent", "tracestate", "baggage")  # what PROPAGATOR reads
_CACHED_W3C_CHARS = 2048  # longer headers are read afresh, so the cache holds at most ~2 MB whatever calls send


def _w3c(traceparent: str | None, tracestate: str | None, bag: str | None) -> tuple[str | None, ...]:
    """(trace id, parent span id, component, the rollout its baggage names) of a call's W3C headers."""
    carrier = {k: v for k, v in zip(W3C_HEADERS, (traceparent, tracestate, bag)) if v is not None}
    ctx = PROPAGATOR.extract(carrier, context=Context())
    span = trace.get_current_span(ctx).get_span_context()
    comp = baggage.get_baggage(COMPONENT_KEY, ctx)
    named = baggage.get_baggage(ROLLOUT_KEY, ctx)
    return (format(span.trace_id, "032x") if span.is_valid else None,
            format(span.span_id, "016x") if span.is_valid else None,
            comp if isinstance(comp, str) and 0 < len(comp) <= 200 and comp.isprintable() else None,
            named if isinstance(named, str) else None)


# A rollout's calls mostly carry the same headers (its span's, its component's), and OpenTelemetry's propagators
# cost more of the gateway's loop than the rest of the call's bookkeeping (benchmarks/README.md, issue 38).
_w3c_cached = functools.lru_cache(maxsize=1024)(_w3c)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    # A whole reply's token ids and log-probs as the backend sent them, read into the lists above on the writer
    # thread (`settle`): a long completion's entries are never walked on the event loop.
    sent: tuple[Any, Any] | None = None

    def settle(self) -> None:
        if self.sent is not None:
            ids, logprobs = self.sent
            self.sent = None
            self.token_ids = list(ids or ())
            self.logprobs = _logprob_values(logprobs)
            self.tokens = _logprob_tokens(logprobs)


class Call:
    """One LLM call the gateway serves: the request as the agent sent it, then the reply, whole or chunk by chunk.
    `end` hands it to the writer thread, which makes its record; what is recorded is what the backend sent."""

    def __init__(self, capture: "Capture", origin: Origin, api: str, request: dict, *, asked: str, policy: str):
        self.capture, self.origin, self.api, self.request = capture, origin, api, request
        self.asked, self.policy = asked, policy
        # From the OS's CSPRNG: a worker that could predict another rollout's call ids could plant spans under them.
        self.call_id = format(secrets.randbits(64) or 1, "016x")
        self.start_ns, self.end_ns = time.time_ns(), 0
        self.status, self.error = 200, None
        self.prompt_ids: list[int] | None = None
        self.choices: dict[int, _Choice] = {}
        # The id of the reply the agent got (what feedback names it by): the backend's, unless the route that
        # answered made its own (the Responses API's `resp_...`) and set it first.
        self.response_id: str | None = None
        self.usage: dict | None = None
        self.server: str | None = None  # the backend (replica) that served it, its base URL
        self._ended = False

    def whole(self, reply: dict) -> None:
        """A non-streamed chat completion (or completion)."""
        self.prompt_ids = _prompt_ids(reply)
        self.response_id, self.usage = self.response_id or reply.get("id"), reply.get("usage")
        for c in reply.get("choices") or ():
            msg = c.get("message") or {}
            ch = self._choice(c.get("index", 0))
            ch.text.append(msg.get("content") or c.get("text") or "")
            ch.tool_calls = dict(enumerate(msg.get("tool_calls") or ()))
            ch.sent = (c.get("token_ids"), c.get("logprobs"))
            ch.finish_reason = c.get("finish_reason")

    def chunk(self, chunk: dict) -> None:
        """One chunk of a streamed chat completion."""
        if _prompt_ids(chunk) is not None:
            self.prompt_ids = _prompt_ids(chunk)
        self.response_id = self.response_id or chunk.get("id")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            ch = self._choice(c.get("index", 0))
            delta = c.get("delta") or {}
            ch.text.append(delta.get("content") or c.get("text") or "")
            for tc in delta.get("tool_calls") or ():
                slot = ch.tool_calls.setdefault(tc.get("index", len(ch.tool_calls)),
                                                {"id": None, "type": "function", "function": {"name": "",
                                                                                           "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            ch.token_ids += c.get("token_ids") or ()
            ch.logprobs += _logprob_values(c.get("logprobs"))
            ch.tokens += _logprob_tokens(c.get("logprobs"))
            ch.finish_reason = c.get("finish_reason") or ch.finish_reason

    def fail(self, status: int, error: str) -> None:
        self.status, self.error = status, error[:2000]

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.end_ns = time.time_ns()
            self.capture.finished(self)

    def _choice(self, index: Any) -> _Choice:
        return self.choices.setdefault(index if isinstance(index, int) else 0, _Choice())

    # ------------------------------------------------------------------------------- on the writer thread

    def record(self) -> SpanRecord:
        o, body = self.origin, self.request
        try:
            for ch in self.choices.values():
                ch.settle()
        except (ValueError, TypeError, AttributeError, KeyError) as e:  # as the route reports a malformed reply
            self.fail(502, f"the backend's reply is malformed: {type(e).__name__}: {e}")
        operation = "text_completion" if self.api == "completions" else "chat"
        first = self.choices.get(0)
        ok = self.status < 400 and first is not None and self.prompt_ids is not None
        if self.status < 400 and not ok:
            self.status, self.error = 502, self.error or "the backend's reply has no choice or no prompt token ids"
        a: dict[str, Any] = {
            "gen_ai.operation.name": operation, "gen_ai.provider.name": "lightning", "gen_ai.request.model": self.asked,
            "gen_ai.response.model": self.policy, API: self.api, POLICY: self.policy,
            "gen_ai.input.messages": json.dumps(_input_messages(body)),
        }
        for key, name in (("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_tokens"),
                          ("max_completion_tokens", "max_tokens"), ("seed", "seed"), ("n", "choice.count"),
                          ("stop", "stop_sequences")):
            if body.get(key) is not None:
                a[f"gen_ai.request.{name}"] = body[key]
        if body.get("tools"):
            a["gen_ai.tool.definitions"] = json.dumps(body["tools"])
        settings = unreproducible(body)
        if settings:
            a[UNREPRODUCIBLE] = settings
        try:
            constraint = from_request(body)
        except ConstraintError:  # the backend refuses it: a failed call, nothing to replay
            constraint = None
        if constraint is not None:  # by value, as the backend applied it: the trainer replays this grammar
            a[CONSTRAINT] = replace(constraint, server=self.capture.grammar).to_json()
        if self.server is not None:  # which replica served it (OpenTelemetry's server.* attributes)
            a["server.address"], port = _address(self.server)
            if port is not None:
                a["server.port"] = port
        if o.rollout is not None:
            a[ROLLOUT_ID], a[ATTEMPT] = o.rollout.rollout_id, o.rollout.attempt
        if o.component is not None:
            a[COMPONENT] = o.component
        if ok:
            a["gen_ai.response.finish_reasons"] = [self.choices[i].finish_reason or "" for i in sorted(self.choices)]
            a["gen_ai.output.messages"] = json.dumps([_output_message(self.choices[i]) for i in sorted(self.choices)])
            a[PROMPT_IDS], a[COMPLETION_IDS] = list(self.prompt_ids), list(first.token_ids)
            if len(first.logprobs) == len(first.token_ids):
                a[COMPLETION_LOGPROBS] = first.logprobs
            if len(first.tokens) == len(first.token_ids):  # shown by the dashboard; never trained on
                a[COMPLETION_TOKENS] = first.tokens
            a["gen_ai.usage.input_tokens"] = len(self.prompt_ids)
            a["gen_ai.usage.output_tokens"] = sum(len(c.token_ids) for c in self.choices.values())
            if self.response_id:
                a["gen_ai.response.id"] = str(self.response_id)
        else:
            a["error.type"] = str(self.status)
        name, error = f"{operation} {self.asked}", None if ok else self.error
        if not self.capture.store_text:
            name, error = operation, None if ok else f"HTTP {self.status} (its message is not stored: store_text off)"
            _drop_text(a, keep_constraint=ok)
        return SpanRecord(
            span_id=self.call_id, trace_id=o.trace_id or "0" * 32, parent_id=o.parent_id,
            rollout_id=o.rollout.rollout_id if o.rollout else "", attempt=o.rollout.attempt if o.rollout else 0,
            component=o.component, name=name, start_ns=self.start_ns, end_ns=self.end_ns,
            status="OK" if ok else "ERROR", status_message=error, attributes=a, source=GATEWAY,
        )


def _drop_text(a: dict[str, Any], *, keep_constraint: bool) -> None:
    """A record without text: no message, stop string, asked model name or setting the app wrote as a string (any
    of them may carry its users' words); the constraint stays on a call that can train (the trainer replays it)."""
    for key in (*TEXT_ATTRIBUTES, "gen_ai.request.model", "gen_ai.request.stop_sequences"):
        a.pop(key, None)
    for key in [k for k, v in a.items() if k.startswith("gen_ai.request.") and not _number(v)]:
        del a[key]
    if not keep_constraint:
        a.pop(CONSTRAINT, None)
    a[TEXT] = TEXT_NOT_STORED


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@functools.lru_cache(maxsize=64)
def _address(url: str) -> tuple[str, int | None]:
    where = urlsplit(url)
    return where.hostname or "", where.port


def _prompt_ids(reply: dict) -> Any:
    """The prompt's token ids: top level (chat completions), or on the first choice (vLLM's completions)."""
    if reply.get("prompt_token_ids") is not None:
        return reply["prompt_token_ids"]
    choices = reply.get("choices") or ()
    return choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None


def _logprob_values(logprobs: Any) -> list[float]:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(content, list):
        return [float(e["logprob"]) for e in content if isinstance(e, dict) and "logprob" in e]
    if isinstance(logprobs, dict) and isinstance(logprobs.get("token_logprobs"), list):  # completions API
        return [float(x) for x in logprobs["token_logprobs"] if x is not None]
    return []


def _logprob_tokens(logprobs: Any) -> list[str]:
    """Each token's text beside its log-prob (chat: content[].token; completions: tokens[])."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(content, list):
        return [str(e.get("token", "")) for e in content if isinstance(e, dict) and "logprob" in e]
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return [str(t) for t, x in zip(logprobs["tokens"], logprobs.get("token_logprobs") or ()) if x is not None]
    return []


def _parts(content: Any) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if isinstance(content, list):
        return [{"type": "text", "content": p.get("text", "")} if isinstance(p, dict) and "text" in p
                else {"type": str(p.get("type", "?")) if isinstance(p, dict) else "?"} for p in content]
    return []


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as the conventions prefer them: the JSON object, when the string is one."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):  # nested past Python's recursion limit: kept as the text it is
            return raw
        return parsed if isinstance(parsed, dict) else raw
    return raw


def _input_messages(body: Mapping[str, Any]) -> list[dict]:
    """The request's messages (or prompt) as OpenTelemetry's gen_ai input messages."""
    if "prompt" in body:
        return [{"role": "user", "parts": [{"type": "text", "content": str(body["prompt"])}]}]
    out = []
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        parts = _parts(m.get("content"))
        for tc in m.get("tool_calls") or ():
            if not isinstance(tc, dict):
                continue
            fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
            parts.append({"type": "tool_call", "id": tc.get("id"), "name": fn.get("name"),
                          "arguments": _arguments(fn.get("arguments"))})
        if m.get("role") == "tool":
            parts = [{"type": "tool_call_response", "id": m.get("tool_call_id"),
                      "response": m.get("content")}]
        out.append({"role": str(m.get("role", "?")), "parts": parts})
    return out


def _output_message(choice: _Choice) -> dict:
    parts = [{"type": "text", "content": "".join(choice.text)}] if "".join(choice.text) else []
    for tc in choice.tool_calls.values():
        fn = tc.get("function") or {}
        parts.append({"type": "tool_call", "id": tc.get("id"), "name": fn.get("name"),
                      "arguments": _arguments(fn.get("arguments"))})
    return {"role": "assistant", "parts": parts, "finish_reason": choice.finish_reason or ""}


class RecordOutlet:
    """Where finished records go, counted: the run's store (`sink`) and the user's tools (`exported`)."""

    def __init__(self) -> None:
        self.sink: CallSink | None = None
        self.exported: Callable[[list[SpanRecord], str], None] | None = None  # records also go to the user's tools
        self.recorded = 0
        self.unattributed = 0  # calls of no open rollout

    def hand_on(self, records: list[SpanRecord]) -> None:
        self.unattributed += sum(1 for r in records if not r.rollout_id)
        if self.sink is not None:
            self.sink.write_calls(records)
        self.recorded += len(records)
        if self.exported is not None:
            self.exported(records, "lightning_sdk.gateway")


class Capture(RecordOutlet):
    """Makes and writes the records of the calls the gateway serves: `begin` a call in a route, `Call.end` it.

    Records go to `sink` (the run's store) from a writer thread of their own (`drain.Drain`); `flush` waits until
    every ended call is written (the runtime calls it before it reads a phase's calls back). Without a sink
    nothing is recorded. `store_text` False: records keep no message text (TEXT_ATTRIBUTES).
    """

    def __init__(self, rollouts: OpenRollouts, *, store_text: bool = True):
        super().__init__()
        self.rollouts = rollouts
        self.store_text = store_text
        # how the backend applies a constraint (its parsers, its tool-call whitespace): Gateway.start sets it
        self.grammar: ServerGrammar | None = None
        self._drain: Drain[Call] | None = None

    @property
    def errors(self) -> list[str]:
        return self._drain.errors if self._drain is not None else []

    def record_to(self, sink: CallSink | None) -> None:
        self.flush()
        self.sink = sink
        if sink is not None and self._drain is None:
            self._drain = Drain(self._write, name="lightning-gateway-records")

    def begin(self, origin: Origin, api: str, request: dict, *, asked: str, policy: str) -> Call:
        return Call(self, origin, api, request, asked=asked, policy=policy)

    def finished(self, call: Call) -> None:
        if self.sink is not None and self._drain is not None:
            self._drain.put(call)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self._drain.flush(timeout_s) if self._drain is not None else True

    def _write(self, calls: list[Call]) -> None:
        self.hand_on([_record(c) for c in calls])


def _record(call: Call) -> SpanRecord:
    """The call's record; a call whose record cannot be made (whatever the agent sent) is recorded failed, alone:
    one request never stops the writer, and with it the run."""
    try:
        return call.record()
    except Exception as e:  # noqa: BLE001 - any fault of one call's content is that call's
        call.fail(500, f"its record could not be made: {type(e).__name__}: {str(e)[:300]}")
        call.request, call.choices, call.prompt_ids = {}, {}, None
        return call.record()
