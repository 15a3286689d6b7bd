"""The inference server under bad input: loopback only, 401 without the key, OpenAI-shaped 4xx for malformed
JSON, huge max_tokens, unknown models and oversized bodies, and a bounded fuzz run after which it still serves.
Also what used to give 5xx or stall it: caller chat templates, a 15 MB message, lone surrogates, seeds past
int64, and slow clients (half-open connections, trickled headers, more connections than the cap).
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sdk.config import ServeConfig
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.gateway.guard import MAX_BODY_BYTES

KEY = "hardening-key"
NAME = "policy"
AUTH = {"Authorization": f"Bearer {KEY}"}
VALID = {"model": NAME, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 2}


HEADER_TIMEOUT = 10  # seconds; the tests open all their sockets well within it
MAX_CONNECTIONS = 350


@pytest.fixture(scope="module")
def server():
    with CPUServer("builtin:tiny-arith", served_model_name=NAME, api_key=KEY, threads=1, max_model_len=128,
                   max_batch_size=8, header_timeout=HEADER_TIMEOUT, max_connections=MAX_CONNECTIONS) as s:
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
    assert_openai_error(http.post("/v1/chat/completions", content=b"x" * (MAX_BODY_BYTES + 1)), 401)
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
    big = json.dumps({**VALID, "pad": "x" * MAX_BODY_BYTES}).encode()
    err = assert_openai_error(http.post("/v1/chat/completions", content=big, headers=AUTH), 413)
    assert str(MAX_BODY_BYTES) in err["message"]

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


def test_caller_chat_templates_are_refused(http):
    loops = "{% for a in range(10**5) %}{% for b in range(10**5) %}{% endfor %}{% endfor %}"
    for field, value in [("chat_template", loops), ("chat_template_kwargs", {"loop": loops, "enable_thinking": False}),
                         ("chat_template_kwargs", {})]:
        r = http.post("/v1/chat/completions", json={**VALID, field: value}, headers=AUTH)
        err = assert_openai_error(r, 400)
        assert err["param"] == field and field in err["message"]
    still_serves(http)


def test_a_15_mb_message_is_refused_before_tokenising_and_health_answers_meanwhile(http, server):
    body = {**VALID, "messages": [{"role": "user", "content": "7 + 8 = 15. " * (15 * 1024 * 1024 // 12)}]}
    health: list[int] = []
    done = threading.Event()

    def probe():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            while not done.is_set():
                health.append(c.get("/health").status_code)

    t = threading.Thread(target=probe)
    t.start()
    try:
        err = assert_openai_error(http.post("/v1/chat/completions", json=body, headers=AUTH), 400)
    finally:
        done.set()
        t.join()
    assert "limit of" in err["message"] and "max_model_len 128" in err["message"] and err["param"] == "messages"
    assert health and set(health) == {200}
    still_serves(http)


SURROGATE = b'"\\ud800"'


def test_lone_surrogates_and_seeds_past_int64_get_4xx(http):
    chat = json.dumps(VALID).encode()
    bodies = {
        "model": ("/v1/chat/completions", chat.replace(b'"policy"', SURROGATE)),
        "messages": ("/v1/chat/completions", chat.replace(b'"What is 2 + 3?"', SURROGATE)),
        "stop": ("/v1/chat/completions", chat[:-1] + b', "stop": [' + SURROGATE + b"]}"),
        "tools": ("/v1/chat/completions", chat[:-1] + b', "tools": [{"type": "function", "function": {"name": '
                  + SURROGATE + b"}}]}"),
        "lora_path": ("/v1/load_lora_adapter", b'{"lora_name": "a", "lora_path": ' + SURROGATE + b"}"),
        "lora_name": ("/v1/unload_lora_adapter", b'{"lora_name": ' + SURROGATE + b"}"),
    }
    tried = 0
    for field, (route, raw) in bodies.items():
        for stream in (False, True):
            if stream and route != "/v1/chat/completions":
                continue
            content = raw[:-1] + b', "stream": true}' if stream else raw
            r = http.post(route, content=content, headers={**AUTH, "Content-Type": "application/json"})
            err = assert_openai_error(r, 400)
            assert err["param"] == field and "surrogate" in err["message"], (field, r.text)
            tried += 1
    for seed in (2**63, 2**64, 2**64 + 1, 10**30, -(2**63) - 1, -(10**30)):
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={**VALID, "seed": seed, "stream": stream}, headers=AUTH)
            assert assert_openai_error(r, 400)["param"] == "seed"
            tried += 1
    for seed in (2**63 - 1, -(2**63), 0):  # int64's ends are fine
        assert http.post("/v1/chat/completions", json={**VALID, "seed": seed}, headers=AUTH).status_code == 200
    print(f"surrogates and seeds: {tried} requests, {tried} answered 400 naming the field")
    still_serves(http)


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_clients_time_out_and_a_connection_cap_answers_503(http, server):
    half_open = []
    for _ in range(300):  # headers begun, never finished
        s = socket.create_connection((server.host, server.port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        half_open.append(s)
    trickle = socket.create_connection((server.host, server.port))  # one header line every 0.5 s
    trickle.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # 302 open: under the cap
        # Beyond the cap: answered 503 at once, OpenAI-shaped, and closed.
        extra = [socket.create_connection((server.host, server.port)) for _ in range(60)]
        sel = selectors.DefaultSelector()
        for s in extra:
            sel.register(s, selectors.EVENT_READ)
        refused = []
        while ready := sel.select(timeout=2):  # what the server answers straight away (the rest stay silent)
            for key, _ in ready:
                sel.unregister(key.fileobj)
                refused.append(_read_until_closed(key.fileobj))
                key.fileobj.close()
        sel.close()
        # 300 half-open + the trickle + the fixture's client hold slots: at least 9 of the 60 are over the cap.
        assert len(refused) >= 60 - (MAX_CONNECTIONS - 300) - 1, len(refused)
        for raw in refused:
            head, _, payload = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), raw[:100]
            assert json.loads(payload)["error"]["code"] == 503
        half_open += [s for s in extra if s.fileno() != -1]
        # Every half-open connection (and the trickle) is closed by the server at the header deadline.
        sel = selectors.DefaultSelector()
        for s in half_open + [trickle]:
            sel.register(s, selectors.EVENT_READ)
        open_, lines, last_line = set(half_open + [trickle]), 0, 0.0
        while open_ and lines < 6 * HEADER_TIMEOUT:  # the trickle would have sent 3x the deadline's worth
            for key, _ in sel.select(timeout=0.5):
                try:
                    closed = not key.fileobj.recv(4096)
                except ConnectionResetError:  # the trickle wrote after the server had closed
                    closed = True
                if closed:
                    sel.unregister(key.fileobj)
                    open_.discard(key.fileobj)
            if trickle in open_ and time.monotonic() - last_line >= 0.5:
                last_line = time.monotonic()
                try:
                    trickle.sendall(f"X-Slow-{lines}: 1\r\n".encode())
                    lines += 1
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed by the server; the select above sees it
        assert not open_, f"{len(open_)} connections left open"
        print(f"slow clients: {len(half_open) + 1} half-open or trickling connections, all closed by the server; "
              f"{len(refused)} of 60 over the cap answered 503; trickle cut after {lines} header lines")
    finally:
        for s in half_open + [trickle]:
            s.close()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    still_serves(http)
    log = server.log_tail(5000)
    assert "Too many open files" not in log and "Traceback" not in log
    assert 1 <= log.count("refused with 503") <= 2  # logged once per 10 s, not once per connection


def test_a_caller_cannot_name_its_own_address_by_forwarded_headers():
    """The remote routes name a caller by request.client (their log lines): a loopback caller's X-Forwarded-For,
    which uvicorn trusts from 127.0.0.1 by default, must not change it."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from lightning_sdk.gateway.listen import ThreadedServer, bind, url_of

    async def who(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.client.host if request.client else "none")

    sock = bind("127.0.0.1", 0)
    server = ThreadedServer(Starlette(routes=[Route("/who", who)]), sock, name="forwarded-test")
    server.start()
    try:
        r = httpx.get(f"{url_of(sock)}/who", headers={"X-Forwarded-For": "203.0.113.7", "X-Forwarded-Proto": "https"})
    finally:
        server.stop()
        sock.close()
    assert r.status_code == 200 and r.text == "127.0.0.1"
    assert "server" not in r.headers  # no software banner either
