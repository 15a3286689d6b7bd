"""OTLP/HTTP trace exports -> span records: what a remote worker's exporter (or any OpenTelemetry SDK, in any
language) sends to a Lightning server's `POST /v1/traces`.

Both encodings of the OTLP/HTTP spec: binary protobuf (`application/x-protobuf`) and JSON (`application/json`:
protobuf's JSON mapping, except that trace and span ids are hex strings), gzip- or deflate-compressed or not.
Attribute values come back as the SDK held them (arrays as lists, kvlists as dicts), so a span decoded here is
the record `records.to_record` makes of the same span in the worker's own process. The decoding is pure CPU
work: a server runs it in a thread, never on its event loop.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status as SpanStatus

from lightning_sdk.tracing.records import ATTEMPT, COMPONENT, ROLLOUT_ID, SpanRecord

PROTOBUF, JSON = "application/x-protobuf", "application/json"
_STATUS = {SpanStatus.STATUS_CODE_UNSET: "UNSET", SpanStatus.STATUS_CODE_OK: "OK",
           SpanStatus.STATUS_CODE_ERROR: "ERROR"}
_ID_KEYS = {"traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id"}
_INVALID_ARGUMENT = 3  # google.rpc.Code
MAX_GZIP_MEMBERS = 16  # far above what an exporter sends (one); concatenated files stay readable


class OtlpError(ValueError):
    """A body the server refuses as a whole: `status` is the HTTP status (400 malformed, 413 too large, 415 not
    an OTLP encoding); nothing of it is stored."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Decoded:
    records: list[SpanRecord]  # the spans that name their rollout
    without_rollout: int  # spans without `lightning.rollout.id`: no rollout can own them


def media_type(content_type: str | None) -> str:
    """`application/json` or `application/x-protobuf` (parameters such as charset ignored); OtlpError if neither."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind not in (PROTOBUF, JSON):
        raise OtlpError(415, f"Content-Type {content_type or '(none)'!r}: OTLP/HTTP is {PROTOBUF} or {JSON}")
    return kind


def decode(body: bytes, *, content_type: str | None, content_encoding: str | None, limit: int) -> Decoded:
    """One export request's spans; OtlpError if any part of it is malformed (then none is taken)."""
    kind = media_type(content_type)
    raw = _decompress(body, (content_encoding or "identity").strip().lower(), limit)
    request = ExportTraceServiceRequest()
    try:
        if kind == PROTOBUF:
            request.ParseFromString(raw)
        else:
            json_format.ParseDict(_hex_ids_to_base64(json.loads(raw)), request, ignore_unknown_fields=True)
    except (DecodeError, json_format.ParseError, ValueError, TypeError, RecursionError) as e:
        what = "protobuf ExportTraceServiceRequest" if kind == PROTOBUF else "OTLP JSON ExportTraceServiceRequest"
        raise OtlpError(400, f"the body is not a valid {what}: {str(e)[:300]}") from None
    records, without = [], 0
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                record = _record(span)
                if record is None:
                    without += 1
                else:
                    records.append(record)
    return Decoded(records, without)


def response(rejected: int = 0, message: str = "", *, kind: str) -> bytes:
    """The ExportTraceServiceResponse in the request's encoding: partial_success only when spans were refused."""
    out = ExportTraceServiceResponse()
    if rejected:
        out.partial_success.rejected_spans = rejected
        out.partial_success.error_message = message
    return _encode(out, kind)


def error(message: str, *, kind: str) -> bytes:
    """The body of a 4xx answer: a google.rpc.Status, as the spec asks, in the request's encoding."""
    return _encode(Status(code=_INVALID_ARGUMENT, message=message), kind)


def _encode(message: Any, kind: str) -> bytes:
    if kind == JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding == "identity":
        if len(body) > limit:
            raise OtlpError(413, f"the body is larger than the limit of {limit} bytes")
        return body
    if encoding not in ("gzip", "deflate"):
        raise OtlpError(415, f"Content-Encoding {encoding!r}: expected gzip, deflate or none")
    # Bounded: a small compressed body may expand to gigabytes (a zip bomb); stop one byte past the limit.
    # A gzip body may hold several members (RFC 1952; `cat a.gz b.gz`): each is read, as gunzip does, so that no
    # span is dropped while the export is answered 200. Members are capped because each one copies the rest of the
    # body (`unused_data`); bytes after a deflate stream are refused.
    raw, rest = b"", body
    for _ in range(MAX_GZIP_MEMBERS):
        inflater = zlib.decompressobj(31 if encoding == "gzip" else 15)
        try:
            raw += inflater.decompress(rest, limit + 1 - len(raw))
        except zlib.error as e:
            raise OtlpError(400, f"the body is not valid {encoding} data ({e})") from None
        if len(raw) > limit:
            raise OtlpError(413, f"the body decompresses to more than the limit of {limit} bytes")
        if not inflater.eof:
            raise OtlpError(400, f"the body is truncated {encoding} data")
        rest = inflater.unused_data
        if not rest:
            return raw
        if encoding != "gzip":
            raise OtlpError(400, f"the body has {len(rest)} byte(s) after the end of its deflate data")
    raise OtlpError(400, f"the body holds more than {MAX_GZIP_MEMBERS} gzip members")


def _hex_ids_to_base64(doc: Any) -> Any:
    """OTLP JSON writes trace and span ids as hex; protobuf's JSON mapping reads bytes as base64."""
    if not isinstance(doc, dict):
        raise TypeError("expected a JSON object at the top level")
    for rs in _items(doc, "resourceSpans", "resource_spans"):
        for ss in _items(rs, "scopeSpans", "scope_spans"):
            for span in _items(ss, "spans"):
                _convert_ids(span)
                for link in _items(span, "links"):
                    _convert_ids(link)
    return doc


def _items(obj: Any, *keys: str) -> list:
    """obj[key] for the first key present, if it is a list of objects (anything else is left to the parser)."""
    if not isinstance(obj, dict):
        return []
    for key in keys:
        if key in obj:
            value = obj[key]
            return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
    return []


def _convert_ids(obj: dict) -> None:
    for key in _ID_KEYS & obj.keys():
        value = obj[key]
        if not isinstance(value, str):
            raise TypeError(f"{key}: expected a hex string, got {type(value).__name__}")
        try:
            obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
        except ValueError:
            raise TypeError(f"{key}: {value[:40]!r} is not a hex string") from None


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":  # JSON has no bytes: base64, as OTLP JSON writes them
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _hex(raw: bytes, size: int, what: str, *, optional: bool = False) -> str | None:
    if optional and not raw:
        return None
    if len(raw) != size or not any(raw):
        raise OtlpError(400, f"span {what}: expected {size} bytes, not all zero (got {binascii.hexlify(raw)[:64]!r})")
    return raw.hex()


def _record(span: Span) -> SpanRecord | None:
    span_id = _hex(span.span_id, 8, "span_id")
    attrs = _attributes(span.attributes)
    rollout_id = attrs.get(ROLLOUT_ID)
    if rollout_id is None:
        return None
    attempt, component = attrs.get(ATTEMPT, 1), attrs.get(COMPONENT)
    if not isinstance(rollout_id, str) or not rollout_id:
        raise OtlpError(400, f"span {span_id}: {ROLLOUT_ID} must be a non-empty string (got {rollout_id!r:.80})")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        raise OtlpError(400, f"span {span_id}: {ATTEMPT} must be an integer >= 1 (got {attempt!r:.80})")
    if component is not None and not isinstance(component, str):
        raise OtlpError(400, f"span {span_id}: {COMPONENT} must be a string (got {component!r:.80})")
    return SpanRecord(
        span_id=span_id,
        trace_id=_hex(span.trace_id, 16, "trace_id"),
        parent_id=_hex(span.parent_span_id, 8, "parent_span_id", optional=True),
        rollout_id=rollout_id,
        attempt=attempt,
        component=component,
        name=span.name,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        status=_STATUS.get(span.status.code, "UNSET"),  # an unknown code (a newer spec): no claim either way
        status_message=span.status.message or None,
        attributes=attrs,
        events=[{"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attributes(e.attributes)}
                for e in span.events],
    )
