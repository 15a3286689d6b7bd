"""Ids that decide what is stored cannot be predicted, and a call's record always wins its id.

The attack (red team, round three): a worker learns enough call ids to rebuild a Mersenne Twister's state, predicts
the id of another rollout's next call and plants a span of its own rollout under it; the store kept the plant and
dropped the honest record, whose rollout then trained nothing. Here: 312 ids (624 32-bit outputs) no longer predict
the next one, and a planted span loses to the record, which trains.
"""

from __future__ import annotations

import secrets

import httpx

from lightning_sdk.gateway.capture import Capture, OpenRollouts, Origin
from lightning_sdk.store import Store
from lightning_sdk.tracing.instrument import PrivateRandomIds
from lightning_sdk.tracing.records import GATEWAY, SpanRecord
from lightning_sdk.transitions import to_transitions

from .remote_harness import KEY, Api, job

AUTH = {"Authorization": f"Bearer {KEY}"}


def _untemper(y: int) -> int:
    """The Mersenne Twister state word behind one 32-bit output (its tempering undone)."""
    y ^= y >> 18
    y ^= (y << 15) & 0xEFC60000
    x = y
    for _ in range(5):
        x = y ^ ((x << 7) & 0x9D2C5680)
    y = x & 0xFFFFFFFF
    x = y
    for _ in range(3):
        x = y ^ (x >> 11)
    return x & 0xFFFFFFFF


def predict_next(ids: list[int]) -> int:
    """The 64-bit id after `ids` (each getrandbits(64): two 32-bit outputs, low word first), if they come from
    one `random.Random`: its state rebuilt from 624 outputs, as an attacker does."""
    import random

    words = []
    for i in ids:
        words += [i & 0xFFFFFFFF, i >> 32]
    state = [_untemper(w) for w in words[-624:]]
    clone = random.Random()
    clone.setstate((3, tuple(state + [624]), None))
    return clone.getrandbits(64)


def test_the_untemper_helper_breaks_a_mersenne_twister():
    import random

    r = random.Random(7)
    seen = [r.getrandbits(64) for _ in range(312)]
    assert predict_next(seen) == r.getrandbits(64)  # the attack works on what the gateway used to use


def test_call_ids_and_span_ids_do_not_follow_from_the_ones_seen():
    capture = Capture(OpenRollouts())
    where = Origin(None, None, None, None)
    calls = [int(capture.begin(where, "chat.completions", {}, asked="m", policy="p").call_id, 16) for _ in range(313)]
    assert predict_next(calls[:312]) != calls[312]
    ids = PrivateRandomIds()
    spans = [ids.generate_span_id() for _ in range(313)]
    assert predict_next(spans[:312]) != spans[312]


def _record(span_id: str, rollout_id: str, source: str, name: str) -> SpanRecord:
    return SpanRecord(span_id=span_id, trace_id="ab" * 16, parent_id=None, rollout_id=rollout_id, attempt=1,
                      component=None, name=name, start_ns=1, end_ns=2, status="OK", status_message=None,
                      source=source)


def test_a_call_s_record_wins_over_a_span_planted_under_its_id(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        assert store.write_spans([_record("00000000000000aa", "attacker", "agent", "plant")]) == []
        assert store.write_calls([_record("00000000000000aa", "victim", GATEWAY, "chat m")]) == []
        [kept] = store.spans("victim")
        assert kept.source == GATEWAY and kept.name == "chat m" and store.spans("attacker") == []
        # ...and a span sent after the record is refused, as before
        assert store.write_spans([_record("00000000000000aa", "attacker", "agent", "plant")]) == ["00000000000000aa"]
        assert store.spans("victim")[0].source == GATEWAY


def test_the_planted_id_attack_against_a_remote_run_keeps_and_trains_the_honest_record(server, tmp_path,
                                                                                      monkeypatch):
    """Two workers over HTTP: the attacker plants a span under the id the victim's next call will get (here told
    to it, the strongest attacker: the ids can no longer be predicted); the victim's call is recorded, kept and
    gives its rollout a transition."""
    api = Api(server, Store(tmp_path / "server.sqlite"))
    try:
        api.queue([job(0, {"question": "?"}), job(1, {"question": "?"})])
        attacker = httpx.post(f"{api.url}/v1/work/claim", json={"worker": "evil"}, headers=AUTH, timeout=30).json()
        victim = httpx.post(f"{api.url}/v1/work/claim", json={"worker": "good"}, headers=AUTH, timeout=30).json()
        planted = secrets.token_hex(8)
        span = {"traceId": attacker["trace_id"], "spanId": planted, "name": "chat m", "startTimeUnixNano": "1",
                "endTimeUnixNano": "2", "attributes": [
                    {"key": "lightning.rollout.id", "value": {"stringValue": attacker["rollout_id"]}},
                    {"key": "lightning.rollout.attempt", "value": {"intValue": "1"}},
                    {"key": "lightning.claim", "value": {"stringValue": attacker["secret"]}}]}
        r = httpx.post(f"{api.url}/v1/traces", json={"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]},
                       headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json() == {}, r.text  # stored: the plant is in
        monkeypatch.setattr(secrets, "randbits", lambda k: int(planted, 16))  # the victim's call gets that id
        r = httpx.post(victim["llm"]["base_url"] + "/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {victim['llm']['api_key']}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 3})
        monkeypatch.undo()
        assert r.status_code == 200 and r.headers["x-lightning-call-id"] == planted
        for who in (attacker, victim):
            r = httpx.post(f"{api.url}/v1/work/{who['rollout_id']}/result", timeout=30,
                           json={"worker": "w", "status": "succeeded", "reward": 1.0},
                           headers={**AUTH, "x-lightning-claim": who["secret"]})
            assert r.status_code == 200
        api.results(2)
        spans = api.store.spans(victim["rollout_id"])
        assert [(s.span_id, s.source) for s in spans] == [(planted, GATEWAY)]
        assert api.store.spans(attacker["rollout_id"]) == []
        transitions = to_transitions(api.store.rollout(victim["rollout_id"]), spans)
        assert len(transitions) == 1 and transitions[0].completion_ids
    finally:
        api.stop()
        api.store.close()
