"""A worker for a remote run written with the standard library only (tests/test_remote_protocol.py runs it): what
an agent in any language with HTTP and JSON does, following docs/remote.md. It never imports lightning_sdk.

usage: python remote_raw_worker.py SERVER_URL TOKEN  ->  prints one JSON line (what it sent, what it got)
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

server, token = sys.argv[1], sys.argv[2]


def call(method, path, body=None, content_type="application/json"):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(server + path, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


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


status, info = call("GET", "/v1/run")
assert status == 200 and not info["over"], (status, info)
status, claim = call("POST", "/v1/work/claim", {"worker": "raw-http"})
assert status == 200, (status, claim)
rid, attempt, llm = claim["rollout_id"], claim["attempt"], claim["llm"]

start = time.time_ns()
messages = [{"role": "user", "content": claim["task"]["question"]}]
status, chat = call("POST", "/v1/chat/completions", {
    "model": "any-model-name", "messages": messages, "max_tokens": 6, "temperature": 1.0,
    "return_token_ids": True, "logprobs": True})
assert status == 200, (status, chat)
end = time.time_ns()
choice = chat["choices"][0]
prompt_ids, completion_ids = chat["prompt_token_ids"], choice["token_ids"]
logprobs = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
text = choice["message"]["content"] or ""

trace_id, call_id, reward_id = os.urandom(16).hex(), os.urandom(8).hex(), os.urandom(8).hex()
ours = [attr("lightning.rollout.id", rid), attr("lightning.rollout.attempt", attempt)]
spans = [
    {"traceId": trace_id, "spanId": call_id, "name": "chat any-model-name", "kind": 3,
     "startTimeUnixNano": str(start), "endTimeUnixNano": str(end), "status": {"code": 1},
     "attributes": ours + [
         attr("lightning.component", "solver"),
         attr("gen_ai.operation.name", "chat"),
         attr("gen_ai.request.model", "any-model-name"),
         attr("gen_ai.request.temperature", 1.0),
         attr("gen_ai.response.finish_reasons", [choice["finish_reason"]]),
         attr("lightning.llm.prompt_token_ids", prompt_ids),
         attr("lightning.llm.completion_token_ids", completion_ids),
         attr("lightning.llm.completion_logprobs", logprobs)]},
    {"traceId": trace_id, "spanId": reward_id, "parentSpanId": call_id, "name": "lightning.reward", "kind": 1,
     "startTimeUnixNano": str(end + 1000), "endTimeUnixNano": str(end + 2000),
     "attributes": ours + [attr("lightning.reward.value", 0.25), attr("lightning.reward.name", "format")]},
]
export = {"resourceSpans": [{"resource": {"attributes": [attr("service.name", "raw-agent")]},
                             "scopeSpans": [{"scope": {"name": "raw"}, "spans": spans}]}]}
status, answer = call("POST", "/v1/traces", export)
assert status == 200 and answer == {}, (status, answer)  # {}: every span taken (no partialSuccess)

reward = float(text.strip() == claim["task"]["answer"])
status, done = call("POST", f"/v1/work/{rid}/result", {"worker": "raw-http", "status": "succeeded", "output": text,
                                                      "reward": reward})
assert status == 200, (status, done)
status, again = call("POST", f"/v1/work/{rid}/result", {"worker": "raw-http", "status": "succeeded", "output": text,
                                                       "reward": reward})
print(json.dumps({"rollout_id": rid, "prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                  "reward": reward, "again": status, "model": llm["model"],
                  "imported_lightning_sdk": any(m.startswith("lightning_sdk") for m in sys.modules)}))
