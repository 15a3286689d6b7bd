"""The serve learner's view of the log (production.reward_log): the same advantages as reading the whole log each
time (the estimator as written before it was kept incrementally, below), with new rewards, calls that join a rewarded
episode later and calls retention deletes; and a refresh reads only the spans of what arrived (real SQLite store,
feedback ledger and retention pass; no model)."""

import hashlib
import json
import random
import sqlite3
import time

import pytest

from lightning_sdk.credit import last_call, lightning_rl, weights
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.production.retention import prune
from lightning_sdk.production.reward_log import RewardLog
from lightning_sdk.production.rewarded import call_advantages
from lightning_sdk.production.traffic_advantage import Rewarded, estimate
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import COMPLETION_IDS, GATEWAY, PROMPT_IDS, SpanRecord

DAY = 86400.0


def whole_log(ledger, store, rule, name="reward", alpha=0.1):
    """rewarded.call_advantages as it read the whole log on every call (kept here as the reference)."""
    samples, rewards = {}, {}
    for row in ledger.rows(name):
        key = row["rollout_id"] if row["kind"] == "episode_id" else row["call_id"]
        if key not in samples:
            calls = [s for s in store.spans(row["rollout_id"] or "") if s.source == GATEWAY]
            samples[key] = calls if row["kind"] == "episode_id" else [c for c in calls if c.span_id == key]
        rewards[key] = rewards.get(key, 0.0) + row["value"]
    key_of = lambda c: hashlib.sha256(json.dumps(c.attributes.get(PROMPT_IDS)).encode()).hexdigest()  # noqa: E731
    episodes = [Rewarded(k, key_of(calls[0]), calls[0].component or "", rewards[k], calls[0].span_id)
                for k, calls in samples.items() if calls]
    by_sample, left_out = {}, 0
    for est in estimate(episodes, alpha=alpha):
        if est.how == "refused":
            continue
        if est.advantage is None:
            left_out += 1
            continue
        calls = samples[est.episode]
        for call, w in zip(calls, weights(rule, calls)):
            by_sample[(est.episode, call.span_id)] = w * est.advantage
    return by_sample, left_out


class App:
    """Traffic as serve records it: calls of no episode (rewarded by response id) and episodes of 1-3 calls."""

    def __init__(self, path, seed=0, start=None):
        self.rng = random.Random(seed)
        self.store = Store(path)
        self.ledger = FeedbackLedger(path, retention_s=30 * DAY)
        self.n = 0
        self.now = start if start is not None else time.time() - 10 * DAY
        self.episodes: list[str] = []

    def call(self, rollout_id, prompt, component=None):
        self.n += 1
        self.now += 1
        ns = int(self.now * 1e9)
        rec = SpanRecord(span_id=f"{self.n:016x}", trace_id=f"{self.n:032x}", parent_id=None, rollout_id=rollout_id,
                         attempt=1, component=component, name="chat", start_ns=ns - 1000, end_ns=ns, status="OK",
                         status_message=None, source=GATEWAY,
                         attributes={PROMPT_IDS: prompt, COMPLETION_IDS: [1, 2], "gen_ai.response.id": f"r-{self.n}"})
        self.store.write_calls([rec])
        return rec

    def give(self, body):
        self.now += 1
        return self.ledger.give(body, now=self.now)

    def traffic(self, n):
        for _ in range(n):
            prompt = [self.rng.randrange(5)]  # five first prompts: same-prompt groups form
            component = self.rng.choice([None, None, "judge"])
            if self.rng.random() < 0.5:
                c = self.call("", prompt, component)
                self.give({"response_id": c.attributes["gen_ai.response.id"], "value": self.rng.choice([0.0, 1.0])})
            else:
                trace = f"{self.rng.getrandbits(128):032x}"
                rid = f"ep-{trace}"
                calls = [self.call(rid, prompt if i == 0 else prompt + [9, i], component)
                         for i in range(self.rng.randint(1, 3))]
                self.episodes.append(trace)
                self.give({"episode_id": trace, "value": self.rng.random()})
                if self.rng.random() < 0.3:  # the same episode's first call also rewarded by its id
                    self.give({"call_id": calls[0].span_id, "value": 0.5})
                if self.rng.random() < 0.1:  # a second reward of the same name: they add up
                    self.give({"episode_id": trace, "value": 0.25, "feedback_id": f"again-{trace}"})

    def close(self):
        self.ledger.close()
        self.store.close()


@pytest.mark.parametrize("rule", [lightning_rl, last_call])
def test_the_kept_view_computes_the_advantages_of_the_whole_log(tmp_path, rule):
    app = App(tmp_path / "serve.sqlite")
    log = RewardLog(app.store, rule, alpha=0.3)
    try:
        app.traffic(150)
        log.refresh()
        assert log.everything() == whole_log(app.ledger, app.store, rule, alpha=0.3)
        for round_ in range(4):
            app.traffic(40)
            # calls that join rewarded episodes after their reward (the last call moves: last_call's weights)
            for trace in app.rng.sample(app.episodes, 5):
                app.call(f"ep-{trace}", [7, round_])
            log.refresh()
            want = whole_log(app.ledger, app.store, rule, alpha=0.3)
            assert log.everything() == want and len(want[0]) > 150
            some = app.rng.sample(sorted({k for k, _ in want[0]}), 30)
            assert log.advantages(some) == {(k, c): a for (k, c), a in want[0].items() if k in some}
        # retention deletes the oldest calls beyond a cap (as a serve without a learner prunes: no reward keeps one)
        gone = prune(app.store.path, retention_s=DAY, max_calls=400, reward_name=None, now=app.now)
        assert gone.over_cap > 0
        log.refresh()
        assert log.everything() == whole_log(app.ledger, app.store, rule, alpha=0.3)
        got = call_advantages(app.store, rule, alpha=0.3)
        assert (got.by_sample, got.no_baseline) == whole_log(app.ledger, app.store, rule, alpha=0.3)
        assert log.rebuilds == 0  # every change was taken in, none by reading the whole log again
    finally:
        log.close()
        app.close()


def test_a_refresh_reads_only_the_spans_of_what_arrived(tmp_path):
    app = App(tmp_path / "serve.sqlite")
    log = RewardLog(app.store, lightning_rl)
    try:
        app.traffic(300)
        log.refresh()
        for _ in range(3):
            before = log.spans_read
            new = [app.call("", [1, 2]) for _ in range(10)]
            for c in new:  # ten calls of no episode, rewarded by response id: one span each
                app.give({"response_id": c.attributes["gen_ai.response.id"], "value": 1.0})
            log.refresh()
            assert log.spans_read - before == 10
        before = log.spans_read
        log.refresh()  # nothing new: nothing read
        assert log.spans_read == before
    finally:
        log.close()
        app.close()


def test_a_non_finite_reward_is_left_out_and_counted_and_learning_goes_on(tmp_path):
    app = App(tmp_path / "serve.sqlite")
    log = RewardLog(app.store, lightning_rl)
    try:
        app.traffic(20)
        c = app.call("", [3])
        db = sqlite3.connect(app.store.path)  # two huge rewards on one response add up to inf: the ledger refuses
        with db:  # them (beyond +-1e6), a store written before it did may hold them
            db.executemany("INSERT INTO feedback VALUES (?, 'response_id', ?, NULL, ?, 'reward', 1.7e308, ?, ?)",
                           [(f"x{i}", c.attributes["gen_ai.response.id"], c.span_id, app.now, app.now + i)
                            for i in range(2)])
        db.close()
        app.traffic(20)
        log.refresh()
        assert log.refused() == 1 and log.advantages([c.span_id]) == {}
        assert log.everything() == whole_log(app.ledger, app.store, lightning_rl)
    finally:
        log.close()
        app.close()


def test_the_dashboards_live_reward_kept_between_polls_equals_reading_the_whole_log(tmp_path):
    from lightning_sdk.production.live_reward import LiveLog, by_adapter, summarize

    app = App(tmp_path / "serve.sqlite")
    view = LiveLog(app.store.path)
    try:
        for round_ in range(3):
            app.traffic(60)
            for trace in app.rng.sample(app.episodes, 4):  # calls joining rewarded episodes
                app.call(f"ep-{trace}", [8, round_])
            if round_ == 2:
                prune(app.store.path, retention_s=DAY, max_calls=150, reward_name=None, now=app.now)
            got = view.summaries()
            want = {a: summarize(a, v) for a, v in by_adapter(app.store.path).items()}
            assert set(got) == set(want) and want
            for a, live in want.items():
                assert got[a].episodes == live.episodes
                assert got[a].mean == pytest.approx(live.mean, abs=1e-12)
                assert got[a].stderr == pytest.approx(live.stderr, abs=1e-12)
        assert view.rebuilds == 0
    finally:
        app.close()


def test_the_learners_read_for_an_update_is_what_arrived_whatever_the_logs_size(tmp_path):
    from lightning_sdk.production.learner import Learner
    from tests.test_serve_learn import project

    def read_for_new_traffic(d, before: int) -> tuple[int, int]:
        d.mkdir()
        cfg = project(d)
        app = App(d / "serve.sqlite", seed=1)
        learner = Learner(cfg, d, app.store, app.ledger, base=cfg.model.name)
        try:
            app.traffic(before)
            learner.transitions(learner.pending())  # the first update: the whole log, once
            seen = max(r["seq"] for r in learner.pending())
            app.rng = random.Random(7)  # the same new traffic in both stores
            app.traffic(40)
            new = [r for r in learner.pending() if r["seq"] > seen]
            # each sample's spans: an episode's, or the one call a reward by id names
            spans = sum({(r["kind"] == "episode_id", r["rollout_id"] if r["kind"] == "episode_id" else r["call_id"]):
                         len(app.store.spans(r["rollout_id"])) if r["kind"] == "episode_id" else 1
                         for r in new}.values())
            start = learner.spans_read
            kept, adv, _, _ = learner.transitions(new)
            want, _ = whole_log(app.ledger, app.store, learner.rule, alpha=cfg.learn.alpha)
            key = lambda t: (t.rollout_id, t.span_id)  # noqa: E731
            assert kept and {key(t): adv[key(t)] for t in kept} == {key(t): want[key(t)] for t in kept}
            return learner.spans_read - start, spans
        finally:
            learner.close()
            app.close()

    small, spans = read_for_new_traffic(tmp_path / "small", 100)
    large, spans_again = read_for_new_traffic(tmp_path / "large", 500)
    # each new reward's calls read twice (the view of the log, then the update's transitions), nothing else
    assert small == large == 2 * spans == 2 * spans_again


def test_the_versions_view_shows_each_adapters_live_reward_poll_after_poll(tmp_path):
    from lightning_sdk.dashboard import versions
    from lightning_sdk.production.live_reward import by_adapter, summarize
    from tests.test_dashboard_serve import LIVE, V2, trace, write_serve

    write_serve(tmp_path)
    path = tmp_path / "serve.sqlite"

    def shown():
        return {r["adapter"]: (r["live"]["mean"], r["live"]["stderr"], r["live"]["episodes"])
                for r in versions.timeline(path)["versions"] if r["live"]}

    got = shown()
    assert set(got) == set(LIVE) and all(got[a] == pytest.approx(LIVE[a]) for a in LIVE)
    ledger = FeedbackLedger(path)
    try:  # a second reward for v2's first episode (0 -> 1) arrives between two polls
        ledger.give({"episode_id": trace("d1"), "value": 1.0, "feedback_id": "later"})
    finally:
        ledger.close()
    want = {a: summarize(a, v) for a, v in by_adapter(path).items()}
    assert shown()[V2] == pytest.approx((want[V2].mean, want[V2].stderr, 2)) and want[V2].mean == 0.75
