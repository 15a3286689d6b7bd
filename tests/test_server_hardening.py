"""The inference server under bad input: loopback only, 401 without the key, OpenAI-shaped 4xx for malformed
JSON, huge max_tokens, unknown models and oversized bodies, and a bounded fuzz run after which it still serves.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sdk.config import ServeConfig
from lightning_sdk.serving.cpu import CPUServer
from lightning_sdk.serving.app import DEFAULT_MAX_BODY_BYTES

KEY = "hardening-key"
NAME = "policy"
AUTH = {"Authorization": f"Bearer {KEY}"}
VALID = {"model": NAME, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    with CPUServer("builtin:tiny-arith", served_model_name=NAME, api_key=KEY, threads=1, max_model_len=128,
                   max_batch_size=8) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["code"] == status and "type" in err
    return err


def still_serves(http) -> None:
    r = http.post("/v1/chat/completions", json=VALID, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"]


def test_binds_loopback_by_default(server):
    assert ServeConfig().host == "127.0.0.1" and server.host == "127.0.0.1"
    # The kernel's own table of listening sockets: the server's port is bound to 127.0.0.1 (0100007F), not 0.0.0.0.
    listening = [line.split() for line in open("/proc/net/tcp").read().splitlines()[1:]]
    local = {fields[1] for fields in listening if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == server.port}
    assert local == {f"0100007F:{server.port:04X}"}


def test_bad_requests_get_openai_shaped_4xx(http):
    assert_openai_error(http.post("/v1/chat/completions", json=VALID), 401)
    assert_openai_error(http.post("/v1/chat/completions", content=b"{oops"), 401)  # auth before parsing
    assert_openai_error(http.post("/v1/chat/completions", content=b"x" * (DEFAULT_MAX_BODY_BYTES + 1)), 401)
    assert_openai_error(http.post("/v1/chat/completions", content=b'{"model": "policy", "messages": [',
                                  headers={**AUTH, "Content-Type": "application/json"}), 400)
    for huge in (10**6, 2**63, 10**30):
        err = assert_openai_error(http.post("/v1/chat/completions", json={**VALID, "max_tokens": huge}, headers=AUTH),
                                  400)
        assert "max_model_len" in err["message"]
    assert_openai_error(http.post("/v1/chat/completions", json={**VALID, "model": "gpt-17"}, headers=AUTH), 404)
    assert_openai_error(http.post("/v1/chat/completions", json={**VALID, "n": 10**9}, headers=AUTH), 400)
    assert_openai_error(http.get("/v1/nowhere", headers=AUTH), 404)
    assert_openai_error(http.get("/v1/chat/completions", headers=AUTH), 405)
    still_serves(http)


def test_oversized_bodies_get_413(http):
    big = json.dumps({**VALID, "pad": "x" * DEFAULT_MAX_BODY_BYTES}).encode()
    err = assert_openai_error(http.post("/v1/chat/completions", content=big, headers=AUTH), 413)
    assert str(DEFAULT_MAX_BODY_BYTES) in err["message"]

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    assert_openai_error(http.post("/v1/chat/completions", content=chunks(), headers=AUTH), 413)
    small = json.dumps(VALID).encode()
    r = http.post("/v1/chat/completions", content=iter([small[:10], small[10:]]),
                  headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200  # a chunked body under the limit is replayed intact
    still_serves(http)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
fields = {
    "model": st.sampled_from([NAME, "", "other"]) | json_values,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "x"]) | json_values,
                                                "content": st.text(max_size=30) | json_values}), max_size=3)
    | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=4) | st.integers() | json_values,
    "n": st.integers(min_value=-1, max_value=12) | json_values,
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | json_values,
    "top_p": st.floats() | json_values,
    "stop": st.lists(st.text(max_size=3), max_size=3) | json_values,
    "logprobs": json_values,
    "top_logprobs": st.integers(min_value=-2, max_value=30) | json_values,
    "stream": st.booleans(),
    "seed": json_values,
}
# Mostly near-valid bodies with some fields broken or missing, plus arbitrary JSON and arbitrary bytes.
bodies = (st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps(d).encode())
          | json_values.map(lambda v: json.dumps(v).encode())
          | st.binary(max_size=200))
requests_ = st.tuples(
    st.sampled_from([("POST", "/v1/chat/completions")] * 16 + [("POST", "/v1/unload_lora_adapter"),
                                                              ("GET", "/v1/models"), ("PUT", "/v1/chat/completions"),
                                                              ("DELETE", "/v1/models")]),
    bodies,
    st.sampled_from([AUTH] * 8 + [{}, {"Authorization": "Bearer wrong"}]),
)


def test_fuzz_1000_malformed_requests_leave_it_serving(http):
    seen: dict[int, int] = {}

    @settings(max_examples=1000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests_)
    def fuzz(req):
        (method, path), body, headers = req
        r = http.request(method, path, content=body, headers={**headers, "Content-Type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.text)
        assert (r.status_code == 401) == (headers != AUTH)  # without the key nothing else is looked at
        if r.status_code >= 400:
            assert_openai_error(r, r.status_code)

    fuzz()
    print(f"fuzz: {sum(seen.values())} requests, status counts {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= 1000
    assert seen.get(400, 0) > 500  # most were malformed, as intended
    still_serves(http)
