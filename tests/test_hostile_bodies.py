"""Single requests that used to stop a run or log a traceback each, on the real gateway in front of the real CPU
server (loopback): bodies nested 10^4 deep on chat, completions and Responses get a 400 and one log line; an
assistant message whose tool-call arguments nest 1,200 `[` deep fails that call alone (400 from the server, recorded
failed) and the writer goes on;
the agents' key opens no /docs or /openapi.json."""

from __future__ import annotations

import logging

import httpx
import pytest

from .conftest import in_rollout, recorded_calls

DEEP = 10_000
BOMB = "[" * 1200 + "]" * 1200  # 2.4 KB: past Python's recursion limit when parsed as JSON


def _deep_body(route: str) -> bytes:
    """A valid JSON request body with a 10^4-deep array where the route's text goes."""
    field = {"/v1/chat/completions": b'"messages": ', "/v1/completions": b'"prompt": ',
             "/v1/responses": b'"input": '}[route]
    return b'{"model": "m", ' + field + b"[" * DEEP + b"]" * DEEP + b"}"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_body_nested_ten_thousand_deep_gets_400_and_one_log_line(gw, route, caplog):
    with caplog.at_level(logging.INFO):
        r = httpx.post(f"{gw.url}{route}", content=_deep_body(route), timeout=30,
                       headers={"Authorization": f"Bearer {gw.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    logged = [rec for rec in caplog.records if rec.name.startswith(("lightning_sdk", "uvicorn", "fastapi"))]
    assert len(logged) == 1 and logged[0].exc_info is None, [rec.getMessage() for rec in logged]
    line = logged[0].getMessage()
    assert "400" in line and "\n" not in line and len(line) < 300, line
    print(f"{route}: {len(line) + 1} bytes logged for a {len(_deep_body(route))}-byte body nested {DEEP} deep")
    assert httpx.get(f"{gw.url}/health").status_code == 200


def test_a_tool_call_nested_1200_deep_fails_that_call_alone_and_the_writer_goes_on(gw, store):
    import openai

    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    messages = [{"role": "user", "content": "1 + 1?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": BOMB}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    with in_rollout(gw, "bomb"):
        with pytest.raises(openai.BadRequestError) as e:  # the server cannot read the arguments: this call fails
            client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert "nested too deeply" in str(e.value) and "arguments" in str(e.value)
        for _ in range(2):  # ...alone: the next calls (on the same connections) are served
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2 + 2?"}],
                                           max_tokens=2)
    calls = recorded_calls(gw, store, "bomb")
    assert gw.capture.errors == [], gw.capture.errors  # the writer did not stop: the run would have
    assert [c.status for c in calls] == ["ERROR", "OK", "OK"]
    assert BOMB in calls[0].attributes["gen_ai.input.messages"]  # the arguments kept as the text they are


def test_the_agents_key_opens_no_docs_or_openapi(gw):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        r = httpx.get(f"{gw.url}{path}", headers={"Authorization": f"Bearer {gw.api_key}"})
        assert r.status_code == 404, (path, r.status_code, r.text[:200])
        assert "/v1/work" not in r.text and "paths" not in r.text
