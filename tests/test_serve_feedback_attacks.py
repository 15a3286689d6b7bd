"""What a key holder can do with `POST /v1/feedback` on a real `lightning serve` (127.0.0.1, the tiny model): a
reward is bounded as a run bounds rewards, a Responses-API reply is rewarded by the `resp_...` id the app got,
a default feedback id cannot be taken first, one call or episode holds a bounded number of rewards, and retention
deletes a reward with the calls it scores without ever giving a rowid twice (issue 52, items 1, 7 and 8)."""

import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

import lightning_sdk as ls
from lightning_sdk.credit import lightning_rl
from lightning_sdk.production.ledger import BY_RESPONSE_ID, FeedbackError, FeedbackLedger
from lightning_sdk.production.retention import prune
from lightning_sdk.production.reward_log import RewardLog
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import COMPLETION_IDS, GATEWAY, PROMPT_IDS, SpanRecord
from tests.projects import deploy

DAY = 86400.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    dep = deploy(tmp_path_factory.mktemp("serve"))
    yield dep
    dep.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0)


def post(served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/feedback", json=body, headers={"Authorization": f"Bearer {served.api_key}"},
                      timeout=30)


def reply_id(client, text="What is 2 + 2?") -> str:
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=2).id


def test_a_reward_beyond_a_runs_bound_is_refused_and_the_most_a_key_holder_can_add_still_trains(served, client):
    target = reply_id(client)
    for huge in (1.7e308, 1e6 * (1 + 1e-9), -1.7e308):
        r = post(served, {"response_id": target, "value": huge, "feedback_id": f"big{huge}"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "value", r.text
        assert "1e+06" in r.json()["error"]["message"]
    r = httpx.post(f"{served.url}/v1/feedback", content=b'{"response_id": "%s", "value": 1%s}' % (target.encode(),
                   b"0" * 400), headers={"Authorization": f"Bearer {served.api_key}"}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "value"  # a 401-digit integer: a line, not a 500
    assert post(served, {"response_id": target, "value": -1e6, "feedback_id": "edge"}).status_code == 200
    # the most one key holder can put on one reply: every slot the cap leaves, each at the bound
    i = 0
    while post(served, {"response_id": target, "value": 1e6, "feedback_id": f"flood{i}"}).status_code == 200:
        i += 1
    for _ in range(8):  # honest traffic after it, so the log has baselines
        post(served, {"response_id": reply_id(client), "value": 1.0})
    log = RewardLog(served.store, lightning_rl)
    try:
        log.refresh()
        advantages, _ = log.everything()  # raised "reward is not a finite number" on an unbounded sum
    finally:
        log.close()
    assert advantages and all(abs(a) < 1e8 for a in advantages.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_app_rewards_its_reply_by_the_resp_id_it_got(served, client, stream):
    if stream:
        events = list(client.responses.create(model="m", input="What is 3 + 3?", max_output_tokens=2, stream=True))
        got = events[-1].response.id  # the last event (completed or incomplete) carries the whole Response
    else:
        got = client.responses.create(model="m", input="What is 3 + 3?", max_output_tokens=2).id
    assert got.startswith("resp_")
    receipt = ls.feedback(1.0, response_id=got, base_url=f"{served.url}/v1", api_key=served.api_key)
    assert (receipt.calls, receipt.duplicate) == (1, False)
    db = sqlite3.connect(served.store.path)
    try:  # the lookup reads the index on the response id, not every call
        plan = " ".join(str(r[-1]) for r in db.execute("EXPLAIN QUERY PLAN " + BY_RESPONSE_ID, (got,)))
        stored = db.execute("SELECT call_id FROM feedback WHERE target=?", (got,)).fetchone()[0]
        span = db.execute("SELECT span_id FROM spans WHERE source=? AND json_extract(attributes, "
                          "'$.\"gen_ai.response.id\"')=?", (GATEWAY, got)).fetchone()[0]
    finally:
        db.close()
    assert "spans_by_response_id" in plan and stored == span


def test_a_default_feedback_id_cannot_be_taken_first(served, client):
    theirs, mine = reply_id(client), reply_id(client)
    # another key holder spells the real app's default id on a reply of their own: refused, nothing written
    squat = post(served, {"response_id": mine, "value": -1.0, "feedback_id": f"response_id:{theirs}:reward"})
    assert squat.status_code == 422 and squat.json()["error"]["param"] == "feedback_id", squat.text
    # ... or rewards the app's reply first under its default id: the app's own reward is still taken
    assert post(served, {"response_id": theirs, "value": -1.0}).status_code == 200
    app = post(served, {"response_id": theirs, "value": 1.0})
    assert app.status_code == 200 and app.json()["duplicate"] is False, app.text
    again = post(served, {"response_id": theirs, "value": 1.0})  # the app's retry: counted once
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert post(served, {"response_id": theirs, "value": 1.0, "feedback_id": f"response_id:{theirs}:reward"}
                ).json()["duplicate"] is True  # an app that spells its own default id gets the same
    retry = post(served, {"response_id": theirs, "value": 1.0, "feedback_id": app.json()["feedback_id"]})
    assert retry.status_code == 200 and retry.json()["duplicate"] is True, retry.text  # ... or the id it was given
    db = sqlite3.connect(served.store.path)
    try:
        values = sorted(v for (v,) in db.execute("SELECT value FROM feedback WHERE target=?", (theirs,)))
    finally:
        db.close()
    assert values == [-1.0, 1.0]


def test_one_reply_holds_a_bounded_number_of_rewards(served, client):
    target = reply_id(client)
    answers = [post(served, {"response_id": target, "value": 1.0, "feedback_id": f"amp{i}"}) for i in range(50)]
    taken = sum(a.status_code == 200 for a in answers)
    assert taken == 16  # not 50: distinct ids do not add up past the cap
    assert served.ledger.max_per_target == 16
    refused = answers[-1]
    assert refused.status_code == 409 and refused.json()["error"]["param"] == "response_id", refused.text
    assert "MAX_FEEDBACK_PER_TARGET = 16" in refused.json()["error"]["message"]
    assert post(served, {"response_id": target, "value": 1.0, "feedback_id": "amp0"}).json()["duplicate"] is True
    episode = "ab" * 16
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   extra_headers={"traceparent": f"00-{episode}-{'cd' * 8}-01"})
    codes = [post(served, {"episode_id": episode, "value": 1.0, "name": f"n{i}"}).status_code for i in range(20)]
    assert codes == [200] * 16 + [409] * 4


def call(i: int, end: float) -> SpanRecord:
    ns = int(end * 1e9)
    return SpanRecord(span_id=f"{i:016x}", trace_id=f"{i:032x}", parent_id=None, rollout_id="", attempt=1,
                      component=None, name="chat", start_ns=ns - 1000, end_ns=ns, status="OK", status_message=None,
                      attributes={PROMPT_IDS: [1], COMPLETION_IDS: [2], "gen_ai.response.id": f"r-{i}"},
                      source=GATEWAY)


def test_retention_deletes_a_reward_with_its_calls_and_never_gives_a_rowid_twice(tmp_path: Path):
    path = tmp_path / "serve.sqlite"
    now = time.time()
    with Store(path) as store:
        store.write_calls([call(i, now - 100 + i) for i in range(10)])
    ledger = FeedbackLedger(path, retention_s=DAY)
    db = sqlite3.connect(path)
    try:
        for i in range(10):
            ledger.give({"response_id": f"r-{i}", "value": float(i % 2)}, now=now)
        first_rowids = [r for (r,) in db.execute("SELECT rowid FROM feedback ORDER BY rowid")]
        db.executemany("INSERT INTO learn_consumed (feedback_id, version) VALUES (?, 1)",
                       [(f"response_id:r-{i}:reward",) for i in range(10)])
        db.commit()
        assert ledger.consumed_through("reward") == max(first_rowids)
        # --max-calls 3 (the rewards are read, so nothing keeps their calls): the calls go and their rewards with them
        p = prune(path, retention_s=DAY, max_calls=3, reward_name="reward", now=now)
        assert p.over_cap == 7
        left = {t for (t,) in db.execute("SELECT target FROM feedback")}
        assert left == {"r-7", "r-8", "r-9"}
        assert db.execute("SELECT COUNT(*) FROM learn_consumed").fetchone()[0] == 3
        # the newest calls go too, but the newest reward's row stays: the next row is numbered after it
        prune(path, retention_s=1e-3, max_calls=None, reward_name="reward", now=now)
        assert [t for (t,) in db.execute("SELECT target FROM feedback")] == ["r-9"]
        with Store(path) as store:
            store.write_calls([call(100, now)])
        ledger.give({"response_id": "r-100", "value": 1.0}, now=now)
        (rowid,) = db.execute("SELECT rowid FROM feedback WHERE target='r-100'").fetchone()
        assert rowid > max(first_rowids)
        assert ledger.consumed_through("reward") == rowid - 1
        assert [r["target"] for r in ledger.unread("reward", ledger.consumed_through("reward"))] == ["r-100"]
    finally:
        db.close()
        ledger.close()


def test_the_ledger_alone_answers_a_number_no_float_holds_with_one_line(served, client):
    """Whatever route it comes by (the HTTP route parses JSON, where an integer may have any number of digits)."""
    rid = reply_id(client)
    for field in ("value", "timestamp"):
        body = {"response_id": rid, "value": 1.0, field: 10 ** 400}
        with pytest.raises(FeedbackError) as e:
            served.ledger.give(body)
        assert (e.value.status, e.value.field) == (422, field), e.value.message
