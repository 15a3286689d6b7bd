"""A worker for a remote run written with the standard library only (tests/test_remote_protocol.py runs it): what
an agent in any language with HTTP and JSON does, following docs/remote.md. It never imports lightning_sdk.

usage: python remote_raw_worker.py SERVER_URL TOKEN  ->  prints one JSON line (what it sent, what it got)

It has no OpenTelemetry: its LLM call goes to the rollout's own base URL (the claim's `llm.base_url`).
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

server, token = sys.argv[1], sys.argv[2]


def call(method, path, body=None, content_type="application/json", *, root=None, key=None, headers=None):
    """(status, decoded body, response headers)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request((root or server) + path, data=data, method=method, headers={
        "Authorization": f"Bearer {key or token}", "Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, (json.loads(raw) if raw else None), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), dict(e.headers)


def attr(key, value):
    if isinstance(value, bool):
        v = {"boolValue": value}
    elif isinstance(value, int):
        v = {"intValue": str(value)}  # int64 as a string, as the protobuf JSON mapping writes it
    elif isinstance(value, float):
        v = {"doubleValue": value}
    elif isinstance(value, list):
        v = {"arrayValue": {"values": [attr("", x)["value"] for x in value]}}
    else:
        v = {"stringValue": value}
    return {"key": key, "value": v}


status, info, _ = call("GET", "/v1/run")
assert status == 200 and not info["over"], (status, info)
status, claim, _ = call("POST", "/v1/work/claim", {"worker": "raw-http"})
assert status == 200, (status, claim)
rid, attempt, llm, secret = claim["rollout_id"], claim["attempt"], claim["llm"], claim["secret"]

# No OpenTelemetry here: the rollout's own base URL tells the gateway which rollout this call is of, and the
# component goes in a W3C baggage header.
messages = [{"role": "user", "content": claim["task"]["question"]}]
status, chat, headers = call("POST", "/chat/completions", {
    "model": "any-model-name", "messages": messages, "max_tokens": 6, "temperature": 1.0},
    root=llm["base_url"], key=llm["api_key"], headers={"baggage": "lightning.component=solver"})
assert status == 200, (status, chat)
end = time.time_ns()
choice = chat["choices"][0]
text = choice["message"]["content"] or ""
call_id = headers.get("x-lightning-call-id") or headers.get("X-Lightning-Call-Id")

# Token ids a worker sends are never training data: the gateway's record is. These would crash a trainer.
trace_id, span_id, reward_id = claim["trace_id"], os.urandom(8).hex(), os.urandom(8).hex()
root = claim["span_id"]  # the rollout's own span, which the server exports: our spans' parent
ours = [attr("lightning.rollout.id", rid), attr("lightning.rollout.attempt", attempt), attr("lightning.claim", secret)]
spans = [
    {"traceId": trace_id, "spanId": span_id, "parentSpanId": root, "name": "chat any-model-name", "kind": 3,
     "startTimeUnixNano": str(end - 10), "endTimeUnixNano": str(end), "status": {"code": 1},
     "attributes": ours + [
         attr("gen_ai.operation.name", "chat"),
         attr("lightning.llm.prompt_token_ids", [10**9, -5]),
         attr("lightning.llm.completion_token_ids", "abc")]},
    {"traceId": trace_id, "spanId": reward_id, "parentSpanId": root, "name": "lightning.reward", "kind": 1,
     "startTimeUnixNano": str(end + 1000), "endTimeUnixNano": str(end + 2000),
     "attributes": ours + [attr("lightning.reward.value", 0.25), attr("lightning.reward.name", "format"),
                           attr("lightning.after_call", call_id)]},
]
export = {"resourceSpans": [{"resource": {"attributes": [attr("service.name", "raw-agent")]},
                             "scopeSpans": [{"scope": {"name": "raw"}, "spans": spans}]}]}
status, answer, _ = call("POST", "/v1/traces", export)
assert status == 200 and answer == {}, (status, answer)  # {}: every span taken (no partialSuccess)

reward = float(text.strip() == claim["task"]["answer"])
result = {"worker": "raw-http", "status": "succeeded", "output": text, "reward": reward}
status, forged, _ = call("POST", f"/v1/work/{rid}/result", result, headers={"x-lightning-claim": "not-the-secret"})
assert status == 403, (status, forged)
status, done, _ = call("POST", f"/v1/work/{rid}/result", result, headers={"x-lightning-claim": secret})
assert status == 200, (status, done)
status, again, _ = call("POST", f"/v1/work/{rid}/result", result, headers={"x-lightning-claim": secret})
print(json.dumps({"rollout_id": rid, "call_id": call_id, "text": text, "reward": reward, "again": status,
                  "model": llm["model"], "base_url": llm["base_url"],
                  "imported_lightning_sdk": any(m.startswith("lightning_sdk") for m in sys.modules)}))
