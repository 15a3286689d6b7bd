"""Issue 52 item 10: the remote dispatcher's memory of worker names is bounded (20,000 bogus results under random
names), and with serve.store_text = false a record keeps no stop string, asked model name or error message (each
may carry the app's users' words)."""

from __future__ import annotations

import json
import secrets
import sqlite3

import httpx
import pytest

from lightning_sdk.rollouts.remote.dispatch import Dispatch
from lightning_sdk.rollouts.remote.protocol import Result
from lightning_sdk.store import Store
from tests.projects import deploy


def test_the_dispatcher_remembers_a_bounded_number_of_worker_names(tmp_path):
    store = Store(tmp_path / "store.sqlite")
    d = Dispatch(store)
    try:
        for k in range(20_000):
            bogus = Result(worker=f"w-{secrets.token_hex(8)}", status="succeeded", output="x", reward=1.0)
            assert d.finish(f"nobody-{k}", bogus, secret=None) is None  # not claimed: ignored
            d.mark_told(bogus.worker)
        assert len(d.seen) <= 5000 and len(d.told_over) <= 5000, (len(d.seen), len(d.told_over))
    finally:
        store.close()


SECRETS = ("SECRET-MODEL", "SECRET-STOP", "SECRET-TEXT", "SECRET-MAX", "SECRET-TOOL", "SECRET-OTHER", "SECRET-TYPE")


@pytest.fixture(scope="module")
def served_without_text(tmp_path_factory):
    dep = deploy(tmp_path_factory.mktemp("serve"), 'store_text = false\n')
    yield dep
    dep.close()


def test_store_text_false_keeps_no_stop_string_asked_model_or_error_text(served_without_text):
    dep = served_without_text
    ask = [{"role": "user", "content": "SECRET-TEXT"}]
    bodies = [
        {"model": "SECRET-MODEL", "stop": ["SECRET-STOP"], "messages": ask, "max_tokens": 2, "temperature": 1.0},
        {"model": "SECRET-MODEL", "messages": ask, "max_tokens": "SECRET-MAX"},
        {"model": "SECRET-MODEL", "messages": ask, "max_tokens": 2,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "SECRET-TYPE"}}}},
        {"model": "SECRET-MODEL", "messages": ask, "max_tokens": 2,
         "tools": [{"type": "function", "function": {"name": "SECRET-TOOL"}}],
         "tool_choice": {"type": "function", "function": {"name": "SECRET-OTHER"}}},
    ]
    codes = [httpx.post(f"{dep.url}/v1/chat/completions", json=b, timeout=60,
                        headers={"Authorization": f"Bearer {dep.api_key}"}).status_code for b in bodies]
    assert codes == [200, 400, 400, 400], codes
    assert dep.gateway.capture.flush()
    db = sqlite3.connect(dep.store.path)
    try:
        rows = db.execute("SELECT name, status_message, attributes FROM spans WHERE source = 'gateway' "
                          "ORDER BY start_ns").fetchall()
    finally:
        db.close()
    assert len(rows) == 4
    for row in rows:
        assert not [s for s in SECRETS if s in str(row)], row
    ok = json.loads(rows[0][2])  # what training reads stays
    assert ok["gen_ai.request.temperature"] == 1.0 and ok["gen_ai.request.max_tokens"] == 2


def test_store_text_false_keeps_no_user_text_from_a_responses_call(served_without_text):
    dep = served_without_text
    bodies = [{"model": "SECRET-RESP-MODEL", "input": "SECRET-RESP-TEXT", "instructions": "SECRET-RESP-INSTR",
               "max_output_tokens": 2},
              {"model": "SECRET-RESP-MODEL", "input": "SECRET-RESP-TEXT", "max_output_tokens": "SECRET-RESP-MAX"}]
    codes = [httpx.post(f"{dep.url}/v1/responses", json=b, timeout=60,
                        headers={"Authorization": f"Bearer {dep.api_key}"}).status_code for b in bodies]
    assert codes[0] == 200 and codes[1] in (400, 422), codes
    assert dep.gateway.capture.flush()
    db = sqlite3.connect(dep.store.path)
    try:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        kept = {t: db.execute(f"SELECT * FROM {t}").fetchall() for t in tables}  # every row of the store
    finally:
        db.close()
    assert any("responses" in str(r) for r in kept["spans"]), "the Responses call was not recorded"
    for table, rows in kept.items():
        for row in rows:
            assert "SECRET-RESP" not in str(row), (table, row)
