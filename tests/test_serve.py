"""`lightning serve`: the run's backend and gateway in front of a deployed app, on 127.0.0.1 with the tiny model;
every call recorded in SQLite, traced calls grouped into episodes, late feedback by reference (each fault one
answer naming its field), episode rewards shared by the credit rule (kill -9 while an update commits:
test_serve_learn.py)."""

import json
import math
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

import lightning_sdk as ls
from lightning_sdk import config
from lightning_sdk.credit import last_call, lightning_rl
from lightning_sdk.production import deployment
from lightning_sdk.production.episodes import episode_id
from lightning_sdk.production.ledger import FeedbackError, FeedbackLedger

TRACE = "ab" * 16


def traced(trace_id: str, span: str = "cd" * 8) -> dict:
    return {"traceparent": f"00-{trace_id}-{span}-01"}


def write_project(directory: Path) -> Path:
    (directory / "train.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    config = directory / "lightning.toml"
    config.write_text('[data]\ntrain = "train.jsonl"\n[model]\nname = "builtin:tiny-arith"\n'
                      '[agent]\nmodule = "app"\n[serve]\nmax_batch_size = 4\n')
    return config


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `lightning serve` (in process, the command's own start) shared by the tests below."""
    d = tmp_path_factory.mktemp("serve")
    cfg = config.load(write_project(d))
    dep = deployment.start(cfg, d / "serve", host="127.0.0.1", port=0, api_key=None, retention_s=3600)
    yield dep
    dep.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0)


def ask(client, headers=None, text="What is 2 + 2?"):
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": text}], max_tokens=4, extra_headers=headers or {})
    return raw.parse().id, raw.headers["x-lightning-call-id"]


def gateway_calls(path: Path) -> list[dict]:
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT span_id, rollout_id, attributes FROM spans "
                                            "WHERE source = 'gateway' ORDER BY start_ns")]
    finally:
        db.close()


def test_an_unchanged_openai_client_is_served_recorded_and_grouped_by_trace_id(served, client):
    trace = "12" * 16
    first = ask(client, traced(trace))
    second = ask(client, traced(trace, "ef" * 8))
    alone = ask(client)
    by_url = openai.OpenAI(base_url=f"{served.url}/rollouts/{trace}/v1", api_key=served.api_key, max_retries=0)
    third = ask(by_url)  # a client with no OpenTelemetry: the per-episode URL
    served.gateway.capture.flush()
    calls = {c["span_id"]: c for c in gateway_calls(served.store.path)}
    assert calls[first[1]]["rollout_id"] == calls[second[1]]["rollout_id"] == calls[third[1]]["rollout_id"] \
        == episode_id(trace)
    assert calls[alone[1]]["rollout_id"] == ""  # no trace id: a call of no episode, still recorded
    attrs = json.loads(calls[first[1]]["attributes"])
    assert attrs["lightning.llm.completion_token_ids"] and len(attrs["lightning.llm.completion_logprobs"]) == len(
        attrs["lightning.llm.completion_token_ids"])
    assert attrs["gen_ai.response.id"] == first[0]
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert httpx.post(f"{served.url}/v1/feedback", json={"call_id": first[1], "value": 1}).status_code == 401
    assert served.url.startswith("http://127.0.0.1:")


def test_feedback_by_response_call_or_episode_and_each_fault_named(served, client):
    response_id, call_id = ask(client, traced(TRACE))
    _, second_call = ask(client, traced(TRACE, "ef" * 8))
    where = {"base_url": f"{served.url}/v1", "api_key": served.api_key}
    assert ls.feedback(1.0, response_id=response_id, name="thumbs", **where).calls == 1
    assert ls.feedback(0.5, call_id=call_id, **where).duplicate is False
    got = ls.feedback(2.0, episode_id=TRACE, name="ticket", **where)
    assert (got.calls, got.duplicate) == (2, False)
    assert ls.feedback(2.0, episode_id=TRACE, name="ticket", **where).duplicate is True  # a retry: counted once
    assert ls.feedback(1.0, episode_id=TRACE, name="own", feedback_id="app-1", **where).duplicate is False
    before = served.ledger.count()

    def refused(expected_status, field, value=1.0, **kw):
        with pytest.raises(ls.FeedbackRefused) as e:
            ls.feedback(value, **kw, **where)
        assert (e.value.status, e.value.field) == (expected_status, field), e.value.message
        assert field in e.value.message
        return e.value

    refused(409, "feedback_id", 3.0, episode_id=TRACE, name="own", feedback_id="app-1")  # its id, another value
    refused(404, "call_id", call_id="0" * 16)
    refused(404, "episode_id", episode_id="9" * 32)
    refused(404, "response_id", response_id="chatcmpl-unknown")
    refused(422, "id", call_id=call_id, episode_id=TRACE)
    refused(422, "name", call_id=call_id, name="")
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="value: expected a finite number"):
            ls.feedback(bad, call_id=second_call, **where)
    for bad in (b"NaN", b"Infinity", b"-Infinity", b'"1"', b"true", b"null"):  # what other clients may send
        reply = httpx.post(f"{served.url}/v1/feedback", content=b'{"call_id": "' + second_call.encode() + b'", '
                           b'"value": ' + bad + b"}", headers={"Authorization": f"Bearer {served.api_key}"})
        assert reply.status_code == 422 and reply.json()["error"]["param"] == "value", (bad, reply.text)
        assert reply.json()["error"]["message"].startswith("value: expected a finite number")
    assert served.ledger.count() == before  # nothing written by any refusal


def test_feedback_for_calls_older_than_the_retention_window_is_refused(served, client):
    _, call_id = ask(client)
    served.gateway.capture.flush()
    ledger = FeedbackLedger(served.store.path, retention_s=60)
    try:
        with pytest.raises(FeedbackError) as e:
            ledger.give({"call_id": call_id, "value": 1.0}, now=time.time() + 61)
        assert (e.value.status, e.value.field) == (410, "call_id")
        assert ledger.give({"call_id": call_id, "value": 1.0, "name": "fresh"}).calls == 1
    finally:
        ledger.close()


def test_an_episode_reward_is_shared_over_its_calls_by_the_credit_rule(served, client):
    trace = "34" * 16
    _, a = ask(client, traced(trace))
    _, b = ask(client, traced(trace, "ef" * 8))
    where = {"base_url": f"{served.url}/v1", "api_key": served.api_key}
    ls.feedback(0.8, episode_id=trace, name="solved", **where)
    ls.feedback(0.25, call_id=a, name="solved", **where)
    assert {k: v for k, v in served.ledger.call_rewards(served.store, lightning_rl, "solved").items()
            if k in (a, b)} == {a: 0.8 + 0.25, b: 0.8}
    assert {k: v for k, v in served.ledger.call_rewards(served.store, last_call, "solved").items()
            if k in (a, b)} == {a: 0.0 + 0.25, b: 0.8}


def test_sigterm_writes_every_answered_call_and_exits_0(tmp_path):
    from tests.test_serve_learn import start_serve

    directory = tmp_path / "served"
    proc, base = start_serve(write_project(tmp_path), directory)
    try:
        _, call_id = ask(openai.OpenAI(base_url=base, api_key="app-key", max_retries=0))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert [c["span_id"] for c in gateway_calls(directory / deployment.STORE_FILE)] == [call_id]


def test_the_traffic_advantage_matches_a_hand_computation():
    from lightning_sdk.production.traffic_advantage import Rewarded, estimate

    eps = [Rewarded("p1-a", "P1", "solver", 1.0), Rewarded("s-1", "S1", "solver", 1.0),
           Rewarded("p1-b", "P1", "solver", 0.0), Rewarded("s-2", "S2", "solver", 0.0),
           Rewarded("p1-c", "P1", "solver", 0.5), Rewarded("s-3", "S3", "solver", 0.5),
           Rewarded("j-1", "J1", "judge", 3.0)]
    got = {e.episode: (e.advantage, e.baseline, e.how) for e in estimate(eps, alpha=0.5)}
    # P1 (n = 3): leave-one-out means (0 + 0.5)/2, (1 + 0.5)/2, (1 + 0)/2.
    assert got["p1-a"] == (0.75, 0.25, "group")
    assert got["p1-b"] == (-0.75, 0.75, "group")
    assert got["p1-c"] == (0.0, 0.5, "group")
    # The solver's running baseline, alpha 0.5, over arrivals 1, 1, 0, 0, 0.5, 0.5:
    # b = 1 (first) -> 1 -> 0.5 -> 0.25 -> 0.375 -> 0.4375; S1 sees 1, S2 sees 0.5, S3 sees 0.375.
    assert got["s-1"] == (0.0, 1.0, "running")
    assert got["s-2"] == (-0.5, 0.5, "running")
    assert got["s-3"] == (0.125, 0.375, "running")
    assert got["j-1"] == (None, None, "none")  # the judge's first episode: no baseline yet
    # a reward that is not a finite number within +-1e6 is refused: no advantage, in no group or baseline
    got = estimate([Rewarded("x", "P", "c", math.nan), Rewarded("y", "P", "c", 1e300), Rewarded("z", "P", "c", 2.0),
                    Rewarded("w", "Q", "c", 1.0)])
    assert [(e.advantage, e.how) for e in got] == [(None, "refused"), (None, "refused"), (None, "none"),
                                                    (-1.0, "running")]


def test_advantages_from_the_log_group_repeated_prompts_and_share_episodes_by_credit(served, client):
    from lightning_sdk.production.rewarded import call_advantages

    where = {"base_url": f"{served.url}/v1", "api_key": served.api_key}
    same = "What is 7 + 1?"
    a1, a2 = ask(client, traced("71" * 16), same)[1], ask(client, traced("71" * 16, "ef" * 8), "and then?")[1]
    b1 = ask(client, traced("72" * 16), same)[1]
    lone = ask(client, text="What is 9 + 9?")[1]
    ls.feedback(1.0, episode_id="71" * 16, name="adv", **where)
    ls.feedback(0.0, episode_id="72" * 16, name="adv", **where)
    ls.feedback(0.3, call_id=lone, name="adv", **where)
    got = call_advantages(served.store, last_call, "adv", alpha=0.5)
    # Both episodes began with the same prompt: leave-one-out, +1 and -1, on the last call of each (last_call).
    assert (got.by_call[a1], got.by_call[a2], got.by_call[b1]) == (0.0, 1.0, -1.0)
    # The lone call (component "") after running baseline 1 -> 0.5: 0.3 - 0.5.
    assert got.by_call[lone] == pytest.approx(-0.2) and got.no_baseline == 0


def test_the_gate_promotes_only_a_candidate_not_worse_by_the_margin_and_stores_why(tmp_path):
    from lightning_sdk.production import gate

    serving = [0.5, 0.5, 0.5, 0.5]
    # d = [0.1, 0.0, 0.1, 0.0]: mean 0.05, stdev sqrt(1/300) = 0.0577, se 0.0289, lower 0.05 - 1.645 * 0.0289
    better = gate.decide("v2", [0.6, 0.5, 0.6, 0.5], "v1", serving, margin=0.0)
    assert better.promoted and better.mean_difference == pytest.approx(0.05)
    assert better.stderr == pytest.approx(math.sqrt(1 / 300) / 2)
    assert better.lower_bound == pytest.approx(0.0025, abs=1e-4)  # 0.05 - 1.645 * 0.0289 >= -0
    # Equal on average but noisy: d = [0.2, -0.2, 0.2, -0.2], se = 0.1155, lower bound -0.19.
    noisy = [0.7, 0.3, 0.7, 0.3]
    assert not gate.decide("v2b", noisy, "v1", serving, margin=0.1).promoted
    assert gate.decide("v2b", noisy, "v1", serving, margin=0.2).promoted
    # Poisoned: d = [-0.3, -0.2, -0.3, -0.2]: mean -0.25, worse by more than any margin below it.
    worse = gate.decide("v3", [0.2, 0.3, 0.2, 0.3], "v1", serving, margin=0.1)
    assert not worse.promoted and "< -margin" in worse.reason
    assert not gate.decide("v4", [1.0], "v1", [0.0], margin=0.1).promoted  # one task: no standard error
    assert not gate.decide("v5", [math.nan, 1.0], "v1", [0.0, 0.0], margin=0.1).promoted
    with pytest.raises(ValueError, match="candidate_scores"):
        gate.decide("v6", [1.0], "v1", [0.0, 0.0], margin=0.1)
    db = tmp_path / "serve.sqlite"
    gate.record(db, better)
    gate.record(db, worse)
    assert gate.decisions(db) == [better, worse]


def test_the_key_is_kept_private_and_a_taken_port_writes_nothing(served, tmp_path):
    kept = Path(served.store.path).parent / deployment.KEY_FILE
    assert deployment.kept_key(kept.parent) == served.api_key and kept.stat().st_mode & 0o777 == 0o600
    port = int(served.url.rsplit(":", 1)[1])
    cfg = config.load(write_project(tmp_path))
    with pytest.raises(OSError):
        deployment.start(cfg, tmp_path / "other", host="127.0.0.1", port=port, api_key=None, retention_s=60)
    assert not (tmp_path / "other").exists()
