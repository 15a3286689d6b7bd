"""One rollout, one trace, in a real collector: Arize Phoenix (a receiver that stores traces and answers queries)
gets the run's spans over OTLP/HTTP, and its own query API says what a user sees there: one root per rollout (the
rollout's span, with task, reward and status), every other span's parent in the same trace, one LLM span per call
(never the client's copy beside the gateway's), and the call's input and output messages.

Phoenix needs its own environment (it pins its own dependencies): `.ci/run` builds it and names its python in
LIGHTNING_TEST_PHOENIX. Without it this test is skipped here, and fails under CI (CI set).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

import lightning_sdk as ls
from lightning_sdk.rollouts.job import RolloutJob
from lightning_sdk.store import Store

from .conftest import SERVED, rollouts_to_collector

PHOENIX = os.environ.get("LIGHTNING_TEST_PHOENIX")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture()
def phoenix(tmp_path):
    if not PHOENIX:
        if os.environ.get("CI"):
            pytest.fail("LIGHTNING_TEST_PHOENIX is not set: .ci/run installs arize-phoenix in a venv of its own")
        pytest.skip("LIGHTNING_TEST_PHOENIX (the python of a venv with arize-phoenix) is not set")
    port = _port()
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(tmp_path / "phoenix"), "PHOENIX_PORT": str(port),
           "PHOENIX_GRPC_PORT": str(_port()), "PHOENIX_HOST": "127.0.0.1", "PHOENIX_TELEMETRY_ENABLED": "false",
           "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false"}
    log = (tmp_path / "phoenix.log").open("w")
    p = subprocess.Popen([PHOENIX, "-m", "phoenix.server.main", "serve"], env=env, stdout=log,
                         stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                _get(f"{url}/v1/projects")
                break
            except OSError:
                assert p.poll() is None, (tmp_path / "phoenix.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "Phoenix did not start in 180 s"
                time.sleep(0.5)
        yield url
    finally:
        p.terminate()
        p.wait(30)
        log.close()


def _spans(url: str, **query: str) -> list[dict]:
    out, cursor = [], None
    while True:
        q = "&".join(f"{k}={v}" for k, v in {**query, "limit": "1000", **({"cursor": cursor} if cursor else {})}.items())
        page = _get(f"{url}/v1/projects/default/spans?{q}")
        out += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return out


def _at(attrs: dict, dotted: str):
    return attrs.get(dotted)


def _messages(attrs: dict, which: str) -> list[tuple[str, str]]:
    """(role, content) of the LLM span's messages as Phoenix read them (`llm.input_messages.N.message.*`)."""
    out, i = [], 0
    while f"llm.{which}_messages.{i}.message.role" in attrs:
        out.append((attrs[f"llm.{which}_messages.{i}.message.role"],
                    attrs.get(f"llm.{which}_messages.{i}.message.content")))
        i += 1
    return out


def test_each_rollout_is_one_tree_in_phoenix(gateway_server, tmp_path, phoenix):
    store = Store(tmp_path / "store.sqlite")
    gw = gateway_server

    @ls.rollout
    async def agent(task, llm):
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            first = await client.chat.completions.create(model=llm.model, max_tokens=3,
                                                         messages=[{"role": "user", "content": task["q"]}])
            ls.emit_reward(0.25, name="format")
            await client.chat.completions.create(model=llm.model, max_tokens=3, messages=[
                {"role": "user", "content": task["q"]}, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Sure?"}])
        if task["fail"]:
            raise RuntimeError("the agent gave up")
        return first.choices[0].message.content

    @ls.reward
    def score(task, output):
        return 1.0

    jobs = [RolloutJob(rollout_id=f"phx-{k}", task_id=f"t{k}", group_id="0:0", iteration=0,
                       task={"q": f"What is {k} + 1?", "fail": k == 2}) for k in range(3)]
    results = rollouts_to_collector(gw, store, phoenix, jobs, agent, score)
    assert [r.status for r in results] == ["succeeded", "succeeded", "failed"]

    expected = 3 * (1 + 2 + 1)  # per rollout: its root, two LLM calls, one reward span
    deadline = time.monotonic() + 60  # Phoenix inserts what it received in batches
    while len(spans := _spans(phoenix)) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(spans) == expected, [s["name"] for s in spans]

    roots = _spans(phoenix, parent_id="null")  # Phoenix's own query for root spans
    assert sorted(_at(r["attributes"], "lightning.rollout.id") for r in roots) == [j.rollout_id for j in jobs]
    for j in jobs:
        trace = [s for s in spans if s["context"]["trace_id"] == j.trace_id]
        (root,) = [r for r in roots if r["context"]["trace_id"] == j.trace_id]
        a = root["attributes"]
        assert root["name"] == "invoke_agent agent" and root["span_kind"] == "AGENT"
        assert _at(a, "lightning.task.id") == j.task_id and json.loads(_at(a, "input.value")) == j.task
        if j.task["fail"]:
            assert root["status_code"] == "ERROR" and "the agent gave up" in root["status_message"]
            assert _at(a, "lightning.rollout.status") == "failed" and _at(a, "lightning.reward.value") is None
        else:
            assert root["status_code"] == "OK" and _at(a, "lightning.rollout.status") == "succeeded"
            assert _at(a, "lightning.reward.value") == 1.0
        # a tree: every span but the root has its parent in the same trace
        ids = {s["context"]["span_id"] for s in trace}
        assert all(s["parent_id"] in ids for s in trace if s["parent_id"])
        assert [s["context"]["span_id"] for s in trace if not s["parent_id"]] == [root["context"]["span_id"]]
        # one LLM span per call: the gateway's record, the same span id the store keeps
        llm_spans = sorted((s for s in trace if s["span_kind"] == "LLM"), key=lambda s: s["start_time"])
        calls = [s for s in store.spans(j.rollout_id) if s.source == "gateway"]
        assert len(llm_spans) == len(calls) == 2
        assert {s["context"]["span_id"] for s in llm_spans} == {c.span_id for c in calls}
        assert all(s["parent_id"] == root["context"]["span_id"] for s in llm_spans)
        for s, n_in in zip(llm_spans, (1, 3)):
            la = s["attributes"]
            assert s["name"] == f"chat {SERVED}"
            inputs = _messages(la, "input")  # Phoenix's reading of gen_ai.input.messages
            assert len(inputs) == n_in and inputs[0] == ("user", j.task["q"]) and inputs[-1][0] == "user"
            assert _at(la, "input.value") == inputs[-1][1]  # the input column: the last message's text
            (call,) = [c for c in calls if c.span_id == s["context"]["span_id"]]
            text = json.loads(call.attributes["gen_ai.output.messages"])[0]["parts"][0]["content"]
            assert _messages(la, "output") == [("assistant", text)] and _at(la, "output.value") == text
        (reward,) = [s for s in trace if s["name"] == "lightning.reward"]
        assert reward["parent_id"] == root["context"]["span_id"]
    store.close()
