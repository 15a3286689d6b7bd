"""learn.canary_share: a candidate past the gate serves a share of new episodes (routed by trace id, one episode on
one adapter), then is promoted to all traffic or rolled back by the live rewards of the two adapters over the same
window; each verdict stored with its evidence, and a restart resumes a running canary from the store. Real parts:
the tiny model's CPU server and the gateway on 127.0.0.1, SQLite, feedback through the ledger, GRPO steps."""

import hashlib
import math
import time

import openai
import pytest

from lightning_sdk.gateway.canary_share import routes_to_canary
from lightning_sdk.production import canary, deployment, live_reward, promotion
from lightning_sdk.production.episodes import episode_id
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import GATEWAY, POLICY, SpanRecord

from tests.test_serve_learn import project, reward_all, traffic


def served(store: Store, span_id: str, episode: str, adapter: str, at: float) -> None:
    """The gateway's record of one call (`episode`: a trace id, or "" for a call of no episode)."""
    store.write_calls([SpanRecord(span_id=span_id, trace_id="0" * 31 + "1", parent_id=None,
                                  rollout_id=episode_id(episode) if episode else "", attempt=1, component=None,
                                  name="chat m", start_ns=int(at * 1e9), end_ns=int(at * 1e9) + 5, status="OK",
                                  status_message=None, source=GATEWAY, attributes={POLICY: adapter})])


def test_the_canary_verdict_matches_a_hand_computation_with_the_episode_as_its_unit(tmp_path):
    path, since = tmp_path / "serve.sqlite", time.time()
    store = Store(path)
    calls = {  # call -> (episode, adapter); the canary "c" beside the serving "s"
        "a1": ("a" * 32, "c"), "a2": ("a" * 32, "c"), "a3": ("a" * 32, "c"),  # one episode of 3 calls, rewarded 1
        "b1": ("b" * 32, "c"),  # one call, rewarded 0
        "l1": ("", "c"),  # a call of no episode, rewarded 0 by its call id
        "f1": ("f" * 32, "c"), "f2": ("f" * 32, "c"),  # rewarded by call id: 1 and 0, so the episode is 0.5
        "c1": ("c" * 32, "s"), "d1": ("d" * 32, "s"), "e1": ("e" * 32, "s"), "e2": ("e" * 32, "s")}
    for n, (span, (episode, adapter)) in enumerate(calls.items()):
        served(store, span, episode, adapter, since + 1 + n)
    served(store, "old", "", "c", since - 60)  # started before the canary: not its window
    store.close()
    ledger = FeedbackLedger(path)
    for body in ({"episode_id": "a" * 32, "value": 1.0}, {"episode_id": "b" * 32, "value": 0.0},
                 {"call_id": "l1", "value": 0.0}, {"call_id": "f1", "value": 1.0}, {"call_id": "f2", "value": 0.0},
                 {"episode_id": "c" * 32, "value": 1.0}, {"episode_id": "d" * 32, "value": 0.0},
                 {"episode_id": "e" * 32, "value": 1.0}, {"call_id": "old", "value": 1.0},
                 {"episode_id": "b" * 32, "value": 5.0, "name": "latency"}):  # another feedback name
        ledger.give(body)
    ledger.close()
    live = live_reward.by_adapter(path, "reward", since=since)
    # one value per episode (sorted by adapter and unit): 7 calls of the canary are 4 units, not 7 samples
    assert sorted(live["c"]) == [0.0, 0.0, 0.5, 1.0] and sorted(live["s"]) == [0.0, 1.0, 1.0]
    # canary 1, 0, 0, 0.5: mean 3/8, var ((5/8)^2 + 2 (3/8)^2 + (1/8)^2) / 3 = 11/48; serving 1, 0, 1: 2/3, var 1/3
    # d = 3/8 - 2/3 = -7/24, se = sqrt(11/48/4 + 1/3/3) = sqrt(97/576) = 0.4104 (per call: d = 4/7 - 3/4 < 0)
    v = canary.judge("c", live["c"], "s", live["s"], min_rewards=3, margin=1.0, z=1.645)
    assert v.mean_difference == pytest.approx(-7 / 24) and v.stderr == pytest.approx(math.sqrt(97 / 576))
    assert v.lower_bound == pytest.approx(-7 / 24 - 1.645 * math.sqrt(97 / 576)) and v.promoted  # -0.966 >= -1
    assert (v.canary_rewards, v.serving_rewards) == (4, 3)
    assert not canary.judge("c", live["c"], "s", live["s"], min_rewards=3, margin=0.5, z=1.645).promoted
    assert canary.judge("c", live["c"], "s", live["s"], min_rewards=4, margin=1.0, z=1.645) is None  # 3 < 4 units
    assert live_reward.summarize("s", live["s"]) == live_reward.Live("s", 2 / 3, pytest.approx(math.sqrt(1 / 9)), 3)


def always_passes(candidate, serving, draw):  # the gate passes every candidate: the canary decides
    return [float(candidate[1])] * 2, [float(serving[1])] * 2


def episodes(dep, salt: str, n: int) -> tuple[list[str], list[str]]:
    """n one-call episodes with fixed trace ids; (the canary's, the serving adapter's) as the replies name them."""
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key=dep.api_key, max_retries=0)
    on_canary, on_serving = [], []
    for i in range(n):
        trace = hashlib.sha256(f"{salt}{i}".encode()).hexdigest()[:32]
        reply = client.chat.completions.create(model="gpt-4o-mini", max_tokens=1,
                                               messages=[{"role": "user", "content": "What is 1 + 1?"}],
                                               extra_headers={"traceparent": f"00-{trace}-{'cd' * 8}-01"})
        assert (reply.model == dep.gateway.canary[0]) == routes_to_canary(trace, 0.5)  # one rule, every call
        (on_canary if reply.model == dep.gateway.canary[0] else on_serving).append(trace)
    dep.gateway.capture.flush()
    return on_canary, on_serving


def rewards(dep, traces: list[str], values: list[int], salt: str) -> None:
    for t, v in zip(traces, values):
        dep.ledger.give({"episode_id": t, "value": float(v), "feedback_id": f"{salt}{t}"})


def test_a_canary_is_routed_a_share_resumed_after_a_restart_then_promoted_or_rolled_back(tmp_path):
    cfg = project(tmp_path, every=4)
    cfg.learn.canary_share, cfg.learn.canary_min_rewards, cfg.learn.gate_margin = 0.5, 3, 0.5
    d = tmp_path / "serve"
    dep = deployment.start(cfg, d, host="127.0.0.1", port=0, api_key=None, retention_s=3600, scorer=always_passes)
    try:
        first = traffic(dep, 4)
        dep.gateway.capture.flush()
        reward_all(dep, first)
        dep.schedule.run_once()  # v1 passes the gate: a canary, not yet promoted
        assert dep.gateway.policy == "builtin:tiny-arith" and dep.gateway.canary == ("app-serve-v1", 0.5)
        on_canary, on_serving = episodes(dep, "a", 16)
        assert 3 <= len(on_canary) <= 13  # the share, on 16 fixed traces
    finally:
        dep.close()  # the canary's row was committed before its first episode: a restart (or kill -9) resumes it
    dep = deployment.start(cfg, d, host="127.0.0.1", port=0, api_key=None, retention_s=3600, scorer=always_passes)
    try:
        assert dep.gateway.canary == ("app-serve-v1", 0.5) and dep.gateway.policy == "builtin:tiny-arith"
        rewards(dep, on_canary, [1, 1], "x")
        rewards(dep, on_serving, [0, 0, 1], "x")
        assert dep.schedule.promoter.check_canary() is None  # 2 < 3 canary rewards
        rewards(dep, on_canary[2:], [0], "x")
        v = dep.schedule.promoter.check_canary()  # d = 1/3, lower -0.442 >= -0.5: promoted
        assert v.promoted and v.lower_bound == pytest.approx(1 / 3 - 1.645 * math.sqrt(2 / 9))
        assert dep.gateway.policy == "app-serve-v1" and dep.gateway.canary is None
        assert dep.schedule.promoter.serving[2] == 1  # the next gate scores candidates against v1
        # v2: passes the gate, then its live reward falls: canary 0,0,1 against 1,1,0, lower -1.109 < -0.5
        second = traffic(dep, 4)
        dep.gateway.capture.flush()
        reward_all(dep, second, salt="v2")
        dep.schedule.run_once()
        assert dep.gateway.canary == ("app-serve-v2", 0.5)
        on_canary, on_serving = episodes(dep, "b", 16)
        rewards(dep, on_canary, [0, 0, 1], "y")
        rewards(dep, on_serving, [1, 1, 0], "y")
        v = dep.schedule.promoter.check_canary()
        assert not v.promoted and v.mean_difference == pytest.approx(-1 / 3)
        assert dep.gateway.policy == "app-serve-v1" and dep.gateway.canary is None  # rolled back
        kept = canary.history(dep.store.path)
        assert [(c["candidate"], c["serving"], c["promoted"]) for c in kept] == [
            ("app-serve-v1", "builtin:tiny-arith", True), ("app-serve-v2", "app-serve-v1", False)]
        assert kept[1]["evidence"]["canary_rewards"] == 3 and kept[1]["evidence"]["serving_rewards"] == 3
        # what a restart serves: v1 (promoted after its canary), and no canary (v2's was decided)
        assert promotion.last_promoted(dep.store.path)[0] == "app-serve-v1"
        assert canary.running(dep.store.path) is None
    finally:
        dep.close()
