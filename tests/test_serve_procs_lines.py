"""Issue 52 item 9: a line where a traceback was. An upload the client aborts on the chat or feedback route is no
traceback; a feedback value or timestamp past a float's range is a 422 naming the field; killing a run's isolated
gateway says one line and no shutdown tracebacks; a line forwarded from the gateway's process says "gateway:" once."""

from __future__ import annotations

import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from lightning_sdk.gateway.isolated import IsolatedGateway
from tests.conftest import SERVED
from tests.projects import deploy, run_one_task


class Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        out = []
        for r in self.records:
            out.append(r.getMessage())
            if r.exc_info:
                out.append(logging.Formatter().formatException(r.exc_info))
        return "\n".join(out)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    dep = deploy(tmp_path_factory.mktemp("serve"))
    yield dep
    dep.close()


@pytest.fixture()
def kept():
    handler = Kept()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "lightning_sdk")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


def abort_upload(url: str, key: str, path: str) -> None:
    """Headers promising 1,000 bytes, 10 of them, then the connection closed."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: 1000\r\n\r\n{{\"value\": ".encode())
        time.sleep(0.05)


def test_uploads_aborted_on_the_chat_and_feedback_routes_are_no_traceback(served, kept):
    for path in ("/v1/chat/completions", "/v1/feedback", "/v1/chat/completions", "/v1/feedback"):
        abort_upload(served.url, served.api_key, path)
    time.sleep(1.0)
    # the server still answers, and nothing was logged as an exception
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    text = kept.text()
    assert "ClientDisconnect" not in text and "Traceback" not in text and "Exception in ASGI" not in text, text


@pytest.mark.parametrize("field", ["value", "timestamp"])
def test_a_401_digit_integer_is_a_422_naming_its_field(served, kept, field):
    body = {"response_id": "chatcmpl-nothing", "value": 1.0, field: 10 ** 400}
    r = httpx.post(f"{served.url}/v1/feedback", content=json.dumps(body), timeout=30,
                   headers={"Authorization": f"Bearer {served.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    assert "Traceback" not in kept.text()


AGENT = '''
import os, signal, threading, time
import psutil
from openai import OpenAI
import lightning_sdk as ls

once = threading.Lock()

@ls.rollout
def solve(task, llm):
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(model=llm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    if once.acquire(blocking=False):  # the first rollout kills the run's gateway; the others are in flight
        for p in psutil.Process().children():
            if "lightning_sdk.gateway.isolated" in " ".join(p.cmdline()):
                os.kill(p.pid, signal.SIGKILL)
    time.sleep(2)
    client.chat.completions.create(model=llm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    return "done"

@ls.reward
def score(task, output):
    return 1.0
'''


def test_killing_the_runs_gateway_says_its_line_without_shutdown_tracebacks(tmp_path):
    code, text = run_one_task(tmp_path, AGENT, group_size=6, timeout=60.0)
    assert code != 0
    assert "gateway's process ended (exit code -9)" in text, text[-3000:]
    assert "unhandled exception during asyncio.run() shutdown" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_line_from_the_gateways_process_says_gateway_once(server, caplog):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there: that replica refuses connections
    g = IsolatedGateway(api_key="agents")
    try:
        g.start([server.url, f"http://127.0.0.1:{port}"], backend_key=server.api_key)
        g.policy = SERVED
        with caplog.at_level(logging.INFO, logger="lightning_sdk"):
            for _ in range(3):
                r = httpx.post(f"{g.base_url}/chat/completions", timeout=60, headers={"Authorization": "Bearer agents"},
                               json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                assert r.status_code == 200, r.text
            g.capture.flush()
            deadline = time.monotonic() + 10
            while "refuses connections" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        g.stop()
    lines = [r.getMessage() for r in caplog.records if "refuses connections" in r.getMessage()]
    assert lines and all(line.startswith("gateway: the inference server") for line in lines), lines
