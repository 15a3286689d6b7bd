"""OTLP/HTTP trace bodies -> span records (rollouts/remote/otlp.py), both encodings, as the spec writes them; and every
malformed body refused as a whole."""

import gzip
import json
import zlib

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from google.protobuf import json_format

from lightning_sdk.rollouts.remote import otlp
from lightning_sdk.rollouts.remote.otlp import OtlpError, decode

LIMIT = 1 << 20
TRACE, SPAN, PARENT = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "eee19b7ec3c1b173"


def _kv(key, value):
    return {"key": key, "value": value}


def _doc(spans):
    return {"resourceSpans": [{"resource": {"attributes": [_kv("service.name", {"stringValue": "agent"})]},
                               "scopeSpans": [{"scope": {"name": "x"}, "spans": spans}]}]}


def _span(**over):
    span = {
        "traceId": TRACE, "spanId": SPAN, "parentSpanId": PARENT, "name": "chat tiny", "kind": 3,
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": 1700000000500000000,
        "attributes": [
            _kv("lightning.rollout.id", {"stringValue": "it0001-a"}),
            _kv("lightning.rollout.attempt", {"intValue": "2"}),
            _kv("lightning.component", {"stringValue": "writer"}),
            _kv("lightning.llm.prompt_token_ids", {"arrayValue": {"values": [{"intValue": "5"}, {"intValue": 7}]}}),
            _kv("lightning.llm.completion_logprobs", {"arrayValue": {"values": [{"doubleValue": -0.25}]}}),
            _kv("gen_ai.request.temperature", {"doubleValue": 1.0}),
            _kv("flag", {"boolValue": True}),
            _kv("nested", {"kvlistValue": {"values": [_kv("a", {"intValue": "1"}),
                                                      _kv("b", {"arrayValue": {"values": [{"stringValue": "x"}]}})]}}),
            _kv("raw", {"bytesValue": "AAE="}),
            _kv("empty", {}),
        ],
        "events": [{"timeUnixNano": "1700000000100000000", "name": "retry",
                    "attributes": [_kv("n", {"intValue": "1"})]}],
        "status": {"code": 2, "message": "tool failed"},
        "unknownField": "receivers ignore it",
    }
    span.update(over)
    return span


def _json(doc, encoding=None):
    body = json.dumps(doc).encode()
    if encoding == "gzip":
        body = gzip.compress(body)
    return decode(body, content_type="application/json; charset=utf-8", content_encoding=encoding, limit=LIMIT)


def test_otlp_json_as_the_spec_writes_it():
    got = _json(_doc([_span(), _span(spanId="eee19b7ec3c1b175", attributes=[])]))
    assert got.without_rollout == 1
    [r] = got.records
    assert (r.trace_id, r.span_id, r.parent_id) == (TRACE, SPAN, PARENT)
    assert (r.rollout_id, r.attempt, r.component, r.name) == ("it0001-a", 2, "writer", "chat tiny")
    assert (r.start_ns, r.end_ns) == (1700000000000000000, 1700000000500000000)
    assert (r.status, r.status_message) == ("ERROR", "tool failed")
    a = r.attributes
    assert a["lightning.llm.prompt_token_ids"] == [5, 7] and a["lightning.llm.completion_logprobs"] == [-0.25]
    assert a["gen_ai.request.temperature"] == 1.0 and a["flag"] is True
    assert a["nested"] == {"a": 1, "b": ["x"]} and a["raw"] == "AAE=" and a["empty"] is None
    assert r.events == [{"name": "retry", "time_ns": 1700000000100000000, "attributes": {"n": 1}}]


def test_protobuf_and_json_give_the_same_records_gzip_or_not():
    doc = _doc([_span()])
    from_json = _json(doc)
    request = ExportTraceServiceRequest()
    json_format.ParseDict(otlp._hex_ids_to_base64(json.loads(json.dumps(doc))), request, ignore_unknown_fields=True)
    raw = request.SerializeToString()
    for body, encoding in ((raw, None), (gzip.compress(raw), "gzip"), (zlib.compress(raw), "deflate")):
        got = decode(body, content_type="application/x-protobuf", content_encoding=encoding, limit=LIMIT)
        assert got == from_json
    assert _json(doc, "gzip") == from_json


def test_response_in_the_request_encoding():
    assert otlp.response(kind=otlp.JSON) == b"{}"
    message = ExportTraceServiceResponse()
    message.ParseFromString(otlp.response(3, "refused", kind=otlp.PROTOBUF))
    assert (message.partial_success.rejected_spans, message.partial_success.error_message) == (3, "refused")
    assert json.loads(otlp.response(3, "refused", kind=otlp.JSON)) == {
        "partialSuccess": {"rejectedSpans": "3", "errorMessage": "refused"}}


@pytest.mark.parametrize("body, status, words", [
    (b"\x00\xff garbage", 400, "not a valid OTLP JSON"),
    (b'{"resourceSpans": "nope"}', 400, "not a valid"),
    (b'[1, 2]', 400, "not a valid"),
    (json.dumps(_doc([_span(traceId="zz")])).encode(), 400, "traceId"),
    (json.dumps(_doc([_span(spanId=12)])).encode(), 400, "spanId"),
    (json.dumps(_doc([_span(spanId="00000000000000")])).encode(), 400, "span_id: expected 8 bytes"),
    (json.dumps(_doc([_span(startTimeUnixNano="soon")])).encode(), 400, "not a valid"),
    (json.dumps(_doc([_span(attributes=[_kv("lightning.rollout.id", {"intValue": "3"})])])).encode(), 400,
     "lightning.rollout.id must be a non-empty string"),
    (json.dumps(_doc([_span(attributes=[_kv("lightning.rollout.id", {"stringValue": "r"}),
                                        _kv("lightning.rollout.attempt", {"stringValue": "1"})])])).encode(), 400,
     "lightning.rollout.attempt must be an integer"),
])
def test_malformed_json_is_refused_whole(body, status, words):
    with pytest.raises(OtlpError) as e:
        decode(body, content_type="application/json", content_encoding=None, limit=LIMIT)
    assert e.value.status == status and words in str(e.value)


def test_malformed_protobuf_encoding_and_size():
    with pytest.raises(OtlpError, match="not a valid protobuf") as e:
        decode(b"\xff\xff\xff\xff garbage", content_type="application/x-protobuf", content_encoding=None, limit=LIMIT)
    assert e.value.status == 400
    with pytest.raises(OtlpError, match="not valid gzip") as e:
        decode(b"not gzip", content_type="application/x-protobuf", content_encoding="gzip", limit=LIMIT)
    assert e.value.status == 400
    with pytest.raises(OtlpError, match="truncated") as e:
        decode(gzip.compress(b"x" * 100)[:-12], content_type="application/x-protobuf", content_encoding="gzip",
               limit=LIMIT)
    with pytest.raises(OtlpError) as e:  # a small body that inflates past the limit (a zip bomb) stops there
        decode(gzip.compress(b"\x00" * (LIMIT * 8)), content_type="application/x-protobuf", content_encoding="gzip",
               limit=LIMIT)
    assert e.value.status == 413
    with pytest.raises(OtlpError) as e:
        decode(b"{}", content_type="text/plain", content_encoding=None, limit=LIMIT)
    assert e.value.status == 415
    with pytest.raises(OtlpError) as e:
        decode(b"{}", content_type="application/json", content_encoding="br", limit=LIMIT)
    assert e.value.status == 415


def test_every_gzip_member_is_read_or_the_body_refused():
    """`cat a.gz b.gz` is one valid gzip body (RFC 1952): its spans are all taken, never only the first member's."""
    first, second = (_doc([_span(spanId=s)]) for s in ("eee19b7ec3c1b174", "eee19b7ec3c1b175"))
    raws = []
    for doc in (first, second):
        request = ExportTraceServiceRequest()
        json_format.ParseDict(otlp._hex_ids_to_base64(json.loads(json.dumps(doc))), request, ignore_unknown_fields=True)
        raws.append(request.SerializeToString())
    got = decode(gzip.compress(raws[0]) + gzip.compress(raws[1]), content_type="application/x-protobuf",
                 content_encoding="gzip", limit=LIMIT)
    assert [r.span_id for r in got.records] == ["eee19b7ec3c1b174", "eee19b7ec3c1b175"]
    # Two JSON documents one after the other are not one OTLP JSON body: refused, not cut to the first.
    with pytest.raises(OtlpError, match="not a valid OTLP JSON") as e:
        decode(gzip.compress(json.dumps(first).encode()) + gzip.compress(json.dumps(second).encode()),
               content_type="application/json", content_encoding="gzip", limit=LIMIT)
    assert e.value.status == 400
    for body, encoding, words in ((gzip.compress(raws[0]) + b"\x00\x00", "gzip", "not valid gzip"),
                                  (gzip.compress(raws[0]) + gzip.compress(raws[1])[:9], "gzip", "truncated"),
                                  (zlib.compress(raws[0]) + zlib.compress(raws[1]), "deflate", "after the end"),
                                  (gzip.compress(b"") * (otlp.MAX_GZIP_MEMBERS + 1), "gzip", "gzip members")):
        with pytest.raises(OtlpError, match=words) as e:
            decode(body, content_type="application/x-protobuf", content_encoding=encoding, limit=LIMIT)
        assert e.value.status == 400
    # The limit counts every member's output together.
    with pytest.raises(OtlpError) as e:
        decode(gzip.compress(b"\x00" * (LIMIT // 2 + 1)) * 2, content_type="application/x-protobuf",
               content_encoding="gzip", limit=LIMIT)
    assert e.value.status == 413
