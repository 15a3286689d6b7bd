"""What a finished span is, as the store keeps it: the record, our attribute names, and the sink it goes to.

Two sources write spans. The gateway writes one span per LLM call it serves (`source = "gateway"`): the call's
training record, made from the request it received and the reply the backend produced (gateway/capture.py). The
agent side writes the rest (`source = "agent"`): tools, framework steps, rewards. The source is set by the code
that stores a span, never read from its content, so nothing an agent or worker sends can pass for a call's record.

Attribute names are namespaced, as OpenTelemetry's conventions ask for non-standard ones; the rest of a span's
attributes are `gen_ai.*` ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

ROLLOUT_ID = "lightning.rollout.id"
ATTEMPT = "lightning.rollout.attempt"
COMPONENT = "lightning.component"
PROMPT_IDS = "lightning.llm.prompt_token_ids"
COMPLETION_IDS = "lightning.llm.completion_token_ids"  # choice 0: the one an agent reads
COMPLETION_LOGPROBS = "lightning.llm.completion_logprobs"
COMPLETION_TOKENS = "lightning.llm.completion_tokens"  # each completion token's text, as the server sent it
POLICY = "lightning.llm.policy"  # the adapter (or base model) name that served the call
API = "lightning.llm.api"  # "chat.completions" | "completions" | "responses": the route the agent called
CONSTRAINT = "lightning.llm.constraint"  # the output constraint it was sampled under (constraint.Constraint.to_json)
UNREPRODUCIBLE = "lightning.llm.unreproducible"  # sampling settings of the call the trainer cannot reproduce
# "not stored": the call's text (messages, reply, token texts, tool definitions) was left out (serve.store_text)
TEXT = "lightning.llm.text"
TEXT_NOT_STORED = "not stored"
AFTER_CALL = "lightning.after_call"  # on agent spans: the latest LLM call (span id) the agent had seen a reply of
CLAIM = "lightning.claim"  # on a remote worker's spans: its claim's secret (checked, then dropped by the server)
REWARD_VALUE = "lightning.reward.value"
REWARD_NAME = "lightning.reward.name"
REWARD_SPAN = "lightning.reward"
# on a rollout's own span (the root of its trace)
TASK_ID = "lightning.task.id"
GROUP_ID = "lightning.group.id"
ITERATION = "lightning.iteration"
PHASE = "lightning.phase"
ROLLOUT_STATUS = "lightning.rollout.status"
TRACER_NAME = "lightning_sdk"
GATEWAY, AGENT = "gateway", "agent"  # SpanRecord.source


@dataclass
class SpanRecord:
    """A finished span as the store keeps it."""

    span_id: str
    trace_id: str
    parent_id: str | None
    rollout_id: str
    attempt: int
    component: str | None
    name: str
    start_ns: int
    end_ns: int
    status: str  # "OK" | "ERROR" | "UNSET"
    status_message: str | None
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    source: str = AGENT  # GATEWAY: an LLM call's record, written by the gateway only

    @property
    def is_error(self) -> bool:
        return self.status == "ERROR"


def is_llm_call(span: SpanRecord) -> bool:
    """What counts as an LLM call of a rollout: the gateway's record of it (an agent's own client spans are for the
    user's observability and never train)."""
    return span.source == GATEWAY


class SpanSink(Protocol):
    """Where finished rollout spans go (the store, or the Ray runtime's writer actor)."""

    def write_spans(self, records: Sequence[SpanRecord]) -> None: ...


class CallSink(Protocol):
    """Where the gateway's call records go (the run's store)."""

    def write_calls(self, records: Sequence[SpanRecord]) -> None: ...


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


def to_record(span: Any) -> SpanRecord | None:
    """An OpenTelemetry `ReadableSpan` -> a record; None for spans outside any rollout."""
    attrs = dict(span.attributes or {})
    rollout_id = attrs.get(ROLLOUT_ID)
    if rollout_id is None:
        return None
    ctx = span.get_span_context()
    return SpanRecord(
        span_id=format(ctx.span_id, "016x"),
        trace_id=format(ctx.trace_id, "032x"),
        parent_id=format(span.parent.span_id, "016x") if span.parent else None,
        rollout_id=str(rollout_id),
        attempt=int(attrs.get(ATTEMPT, 1)),
        component=attrs.get(COMPONENT),
        name=span.name,
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        status=span.status.status_code.name,
        status_message=span.status.description,
        attributes={k: _plain(v) for k, v in attrs.items()},
        events=[{"name": e.name, "time_ns": e.timestamp,
                 "attributes": {k: _plain(v) for k, v in (e.attributes or {}).items()}} for e in span.events],
    )


def to_span(record: SpanRecord, *, resource: Any, scope: Any) -> Any:
    """A record back as an OpenTelemetry `ReadableSpan` (what exporters take): a span a remote worker sent, to be
    exported as if it was recorded here. A kvlist attribute (no OpenTelemetry attribute type) becomes JSON text."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    def value(v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else json.dumps(v) if isinstance(v, dict) else v

    trace_id, flags = int(record.trace_id, 16), TraceFlags(TraceFlags.SAMPLED)
    code = StatusCode[record.status] if record.status in StatusCode.__members__ else StatusCode.UNSET
    return ReadableSpan(
        name=record.name,
        context=SpanContext(trace_id, int(record.span_id, 16), is_remote=False, trace_flags=flags),
        parent=(SpanContext(trace_id, int(record.parent_id, 16), is_remote=True, trace_flags=flags)
                if record.parent_id else None),
        resource=resource, kind=SpanKind.INTERNAL, instrumentation_scope=scope,
        attributes={k: value(v) for k, v in record.attributes.items()},
        events=[Event(e["name"], {k: value(v) for k, v in (e.get("attributes") or {}).items()}, e["time_ns"])
                for e in record.events],
        status=Status(code, record.status_message if code is StatusCode.ERROR else None),
        start_time=record.start_ns, end_time=record.end_ns,
    )


def messages(attrs: dict[str, Any], direction: str) -> list[dict[str, Any]]:
    """The call's messages as [{role, parts: [{type, content, ...}]}]: `gen_ai.{input,output}.messages` JSON
    (current conventions), or the legacy numbered `gen_ai.prompt.N.*` / `gen_ai.completion.N.*` attributes."""
    raw = attrs.get(f"gen_ai.{direction}.messages")
    if raw:
        try:
            parsed = json.loads(raw) if isinstance(raw, str) else raw
            if isinstance(parsed, list):
                return [m if isinstance(m, dict) else {"role": "?", "parts": [{"type": "text", "content": str(m)}]}
                        for m in parsed]
        except ValueError:
            pass
        return [{"role": "?", "parts": [{"type": "text", "content": str(raw)}]}]
    prefix = "gen_ai.prompt." if direction == "input" else "gen_ai.completion."
    out, i = [], 0
    while f"{prefix}{i}.role" in attrs or f"{prefix}{i}.content" in attrs:
        out.append({"role": attrs.get(f"{prefix}{i}.role", "?"),
                    "parts": [{"type": "text", "content": str(attrs.get(f"{prefix}{i}.content", ""))}]})
        i += 1
    return out
