"""A worker that sends garbage (tests/test_untrusted_worker.py): standard library only, never lightning_sdk.

usage: python remote_evil_worker.py SERVER_URL TOKEN N  ->  claims N rollouts, does one bad thing to each (in
turn, the list below), prints one JSON line per rollout: what it did and what the server answered.
"""

import json
import os
import sys
import urllib.error
import urllib.request

server, token, n = sys.argv[1], sys.argv[2], int(sys.argv[3])


def call(method, url, body=None, key=None, headers=None):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {key or token}", "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:300].decode("utf-8", "replace")


def attr(key, value):
    if isinstance(value, float):
        v = {"doubleValue": value}
    elif isinstance(value, int):
        v = {"intValue": str(value)}
    elif isinstance(value, list):
        v = {"arrayValue": {"values": [attr("", x)["value"] for x in value]}}
    else:
        v = {"stringValue": value}
    return {"key": key, "value": v}


def spans(claim, extra, name="chat gpt-4o-mini"):
    ours = [attr("lightning.rollout.id", claim["rollout_id"]), attr("lightning.rollout.attempt", claim["attempt"]),
            attr("lightning.claim", claim["secret"])]
    span = {"traceId": claim["trace_id"], "spanId": os.urandom(8).hex(), "name": name, "startTimeUnixNano": "1",
            "endTimeUnixNano": "2", "attributes": ours + extra}
    return {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}


def chat(claim, content):
    return call("POST", claim["llm"]["base_url"] + "/chat/completions",
                {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], "max_tokens": 4},
                key=claim["llm"]["api_key"])


BAD = ["nan_reward", "string_reward", "bogus_token_ids", "prompt_too_long", "nan_reward_span", "foreign_result",
       "huge_reward", "unbounded_reward"]
status, info = call("GET", server + "/v1/run")
held = []
for k in range(n):
    status, claim = call("POST", server + "/v1/work/claim", {"worker": "evil"})
    while status == 204:  # no work yet (a loaded machine: the run still starting): claim again, as workers do
        status, claim = call("POST", server + "/v1/work/claim", {"worker": "evil"})
    if status != 200:
        break
    what = BAD[k % len(BAD)]
    mine = {"x-lightning-claim": claim["secret"]}
    result = {"worker": "evil", "status": "succeeded", "reward": 1.0}
    url = f"{server}/v1/work/{claim['rollout_id']}/result"
    if what == "nan_reward":
        answer = call("POST", url, b'{"worker": "evil", "status": "succeeded", "reward": NaN}', headers=mine)
    elif what in ("huge_reward", "unbounded_reward"):  # finite, but past the bound of +-1e6
        answer = call("POST", url, {**result, "reward": 1.7e308 if what == "huge_reward" else 1000001.0},
                      headers=mine)
    elif what == "string_reward":
        answer = call("POST", url, {**result, "reward": "abc"}, headers=mine)
    elif what == "bogus_token_ids":  # a real call, then spans with ids that would crash a trainer that read them
        chat(claim, claim["task"]["question"])
        call("POST", server + "/v1/traces", spans(claim, [
            attr("lightning.llm.prompt_token_ids", [10**9, -5]), attr("lightning.llm.completion_token_ids", "abc"),
            attr("lightning.llm.completion_logprobs", [0.5, 0.1, 0.2])]))
        answer = call("POST", url, result, headers=mine)
    elif what == "prompt_too_long":  # more tokens than the model holds: the gateway's call fails, recorded
        answer = chat(claim, "1 + 1 = 2. " * 3000)
        answer = (answer[0], call("POST", url, result, headers=mine))
    elif what == "nan_reward_span":
        chat(claim, claim["task"]["question"])
        call("POST", server + "/v1/traces", spans(claim, [attr("lightning.reward.value", "nan")],
                                                  name="lightning.reward"))
        answer = call("POST", url, result, headers=mine)
    else:  # report a result for a rollout with a secret that is not its claim's: refused, then its own
        answer = call("POST", url, result, headers={"x-lightning-claim": "a-guess"})
        answer = (answer[0], call("POST", url, {**result, "reward": 0.0}, headers=mine))
    print(json.dumps({"rollout_id": claim["rollout_id"], "did": what, "answer": answer}), flush=True)
