"""Issue 52, items 3 and 11: the serve learner's rewards. A reward far beyond what a run allows (1e300: an old store
holds it, written before feedback was bounded) is left out and counted, never enters a baseline, and makes no
version; an update whose every optimizer step was skipped makes none either; the evidence stored is strict JSON.
Advantages are keyed by (sample, call): a call rewarded by its id and as part of its episode trains once per sample,
each time with that sample's own advantage, only when that sample's reward is read, and the leave-one-out baseline
counts the reply once. Real SQLite store and ledger, the real Learner; the update tests take real GRPO steps on the
builtin tiny model."""

import json
import math
import sqlite3

import pytest

from lightning_sdk import config
from lightning_sdk.production.learner import Learner
from lightning_sdk.production.rewarded import call_advantages
from lightning_sdk.credit import lightning_rl
from lightning_sdk.production import traffic_advantage
from tests.test_serve_learn import project
from tests.test_serve_reward_log import App

FLOAT32_MAX = 3.4028234663852886e38


def old_reward(app: App, call, value: float, fid: str) -> None:
    """A reward by call id as a store written before feedback was bounded holds it (the ledger's own row)."""
    app.now += 1
    db = sqlite3.connect(app.store.path)
    with db:
        db.execute("INSERT INTO feedback VALUES (?,?,?,?,?,?,?,?,?)",
                   (fid, "call_id", call.span_id, call.rollout_id, call.span_id, "reward", value, app.now, app.now))
    db.close()


def learner_on(d, credit: str | None = None):
    d.mkdir()
    project(d)
    if credit is not None:
        with open(d / "lightning.toml", "a") as f:
            f.write(f'[rollout]\ncredit = "{credit}"\n')
    cfg = config.load(d / "lightning.toml")
    app = App(d / "serve.sqlite", seed=3)
    return cfg, app, Learner(cfg, d, app.store, app.ledger, base=cfg.model.name)


def trained(learner: Learner, rows) -> dict[tuple[str, str], list[float]]:
    """(sample, call) -> the advantages the update would train that transition with (one per transition)."""
    kept, adv, _, _ = learner.transitions(rows)
    out: dict[tuple[str, str], list[float]] = {}
    for t in kept:  # main keyed advantages by call alone; this branch by (sample, call)
        out.setdefault((t.rollout_id, t.span_id), []).append(adv.get((t.rollout_id, t.span_id), adv.get(t.span_id)))
    return out


# ------------------------------------------------------------------------------------------------ item 11


def test_a_call_in_two_samples_trains_with_each_samples_own_advantage(tmp_path):
    """The issue's update: a call whose own reward was 1.0 (its episode 0.5) was trained twice at -0.0738."""
    cfg, app, learner = learner_on(tmp_path / "p")
    try:
        y = app.call("", [5])  # another reply to the same prompt, earlier
        app.give({"call_id": y.span_id, "value": 0.8238})
        c1, c2 = app.call("ep-" + "a" * 32, [5]), app.call("ep-" + "a" * 32, [5, 9])
        app.give({"call_id": c1.span_id, "value": 1.0})
        app.give({"episode_id": "a" * 32, "value": 0.5})
        got = trained(learner, learner.pending())
        ep = c1.rollout_id
        # replies of the prompt: y (0.8238) and c1 (its call and episode samples: one reply), leave-one-out
        assert got[(c1.span_id, c1.span_id)] == [pytest.approx(1.0 - 0.8238)]  # main: -0.0738
        assert got[(ep, c1.span_id)] == [pytest.approx(0.5 - 0.8238)]  # main: -0.0738 again
        assert got[(ep, c2.span_id)] == [pytest.approx(0.5 - 0.8238)]
    finally:
        learner.close()
        app.close()


def test_an_update_trains_only_the_samples_it_read(tmp_path):
    cfg, app, learner = learner_on(tmp_path / "p")
    try:
        y = app.call("", [5])
        app.give({"call_id": y.span_id, "value": 0.8238})
        c1, c2 = app.call("ep-" + "b" * 32, [5]), app.call("ep-" + "b" * 32, [5, 9])
        app.give({"call_id": c1.span_id, "value": 1.0})
        first = learner.pending()
        assert trained(learner, first)[(c1.span_id, c1.span_id)] == [pytest.approx(1.0 - 0.8238)]
        seen = max(r["seq"] for r in first)
        app.give({"episode_id": "b" * 32, "value": 0.5})
        second = [r for r in learner.pending() if r["seq"] > seen]
        got = trained(learner, second)  # the episode alone: the call's own sample was the first update's
        assert set(got) == {(c1.rollout_id, c1.span_id), (c1.rollout_id, c2.span_id)}
        assert got[(c1.rollout_id, c1.span_id)] == [pytest.approx(0.5 - 0.8238)]  # main: + the call's 0.176 again
    finally:
        learner.close()
        app.close()


def test_a_leave_one_out_baseline_counts_a_reply_once(tmp_path):
    """The issue's A = 0.5 where 0.667 is right: an episode and its first call, both rewarded, are one reply, so the
    prompt has no second reply and the running baseline (1/3) is the call's baseline, not its own episode's 0.5."""
    cfg, app, learner = learner_on(tmp_path / "p", credit="last_call")  # the first call's advantage is its own
    try:
        x = app.call("", [1])  # the component's first sample: the running baseline starts at 1/3
        app.give({"call_id": x.span_id, "value": 1 / 3})
        c1, c2 = app.call("ep-" + "c" * 32, [5]), app.call("ep-" + "c" * 32, [5, 9])
        app.give({"call_id": c1.span_id, "value": 1.0})
        app.give({"episode_id": "c" * 32, "value": 0.5})
        got = trained(learner, learner.pending())
        assert got[(c1.span_id, c1.span_id)] == [pytest.approx(2 / 3)]  # main: 0.5 (1.0 - its own episode's 0.5)
        # the episode: after the call, the running baseline is 1/3 + 0.1 * (1 - 1/3) = 0.4 (main: 0.5 - 1.0)
        assert got[(c1.rollout_id, c2.span_id)] == [pytest.approx(0.1)]
    finally:
        learner.close()
        app.close()


# ------------------------------------------------------------------------------------------------- item 3


def test_an_absurd_reward_is_left_out_counted_and_never_in_a_baseline(tmp_path):
    def log(d, absurd: bool):
        d.mkdir()
        app = App(d / "serve.sqlite", seed=5)
        try:
            app.traffic(30)
            c = app.call("", [3])
            if absurd:
                old_reward(app, c, 1e300, "huge")
            app.traffic(30)
            return call_advantages(app.store, lightning_rl), c.span_id
        finally:
            app.close()

    clean, _ = log(tmp_path / "clean", absurd=False)
    poisoned, call = log(tmp_path / "poisoned", absurd=True)
    assert call not in poisoned.by_call
    # every other sample's advantage is what it is without the absurd reward: no baseline held it
    assert poisoned.by_call == clean.by_call  # main: the running baseline held ~1e299 for the rest of the log
    assert poisoned.refused == 1 and clean.refused == 0


def test_a_store_with_an_absurd_reward_keeps_every_baseline_within_float32(tmp_path):
    from lightning_sdk.production.reward_log import RewardLog

    app = App(tmp_path / "serve.sqlite", seed=6)
    log = RewardLog(app.store, lightning_rl)
    try:
        app.traffic(10)
        old_reward(app, app.call("", [3]), -1e300, "huge")
        app.traffic(30)
        log.refresh()
        held = [v for s in log.samples.values() for v in (s.before, s.after) if v is not None]
        assert held and max(abs(v) for v in held) <= 1e6 < FLOAT32_MAX
    finally:
        log.close()
        app.close()


def strict(text: str):
    def refuse(c):
        raise ValueError(f"not JSON: {c}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("bound", ["kept", "lifted"])
def test_no_version_is_made_without_an_optimizer_step(tmp_path, monkeypatch, bound):
    """An update over a sample rewarded 1e300 (and one honest sample that starts the baseline). With the bound kept
    the sample is refused; with it lifted (as if the learner had none) its advantage reaches the real trainer,
    whose every optimizer step is skipped for a non-finite gradient. Either way no version: on main, version 1 was
    made (a copy of the base) with NaN in its evidence."""
    if bound == "lifted":
        monkeypatch.setattr(traffic_advantage, "MAX_ABS_REWARD", math.inf, raising=False)
    cfg, app, learner = learner_on(tmp_path / "p")
    try:
        x = app.call("", [1, 2, 3])
        app.give({"call_id": x.span_id, "value": 0.5})
        old_reward(app, app.call("", [1, 2, 4]), 1e300, "huge")
        update = learner.update()
        assert update.version is None and learner.updates() == []
        if bound == "kept":
            assert update.skipped.get("reward_refused") == 1 and update.reason is None
        else:
            assert update.reason.startswith("no optimizer step taken") and learner._trainer is None
        db = sqlite3.connect(app.store.path)
        consumed = db.execute("SELECT COUNT(*), COUNT(version) FROM learn_consumed").fetchone()
        db.close()
        assert consumed == (2, 0)  # both read, no version: learning goes on past them
        if bound == "kept":  # an honest reward after them trains: version 1 (with no bound the running baseline
            y = app.call("", [1, 2, 5])  # would hold ~1e299, every later advantage as absurd)
            app.give({"call_id": y.span_id, "value": 1.0})
            assert learner.update().version == 1
    finally:
        learner.close()
        app.close()


def test_an_updates_evidence_is_strict_json(tmp_path):
    """Calls recorded without sampler log-probs: the update's logprob_gap is not a number (main stored NaN, and
    SQLite's json_extract over learn_updates failed: malformed JSON)."""
    cfg, app, learner = learner_on(tmp_path / "p")
    try:
        for prompt, value in (([1, 2, 3], 0.5), ([1, 2, 5], 1.0)):
            c = app.call("", prompt)
            app.give({"call_id": c.span_id, "value": value})
        assert learner.update().version == 1
        db = sqlite3.connect(app.store.path)
        try:
            assert db.execute("SELECT json_extract(evidence, '$.metrics.logprob_gap'), "
                              "json_extract(evidence, '$.nonfinite') FROM learn_updates").fetchall() == [
                (None, '["metrics.logprob_gap"]')]
        finally:
            db.close()
        evidence = strict(learner.updates()[0]["evidence"])
        assert math.isfinite(evidence["metrics"]["loss"]) and evidence["metrics"]["logprob_gap"] is None
    finally:
        learner.close()
        app.close()


# ---------------------------------------------------- feedback rows deleted (retention pruning them with their calls)


@pytest.mark.parametrize("which", ["oldest", "newest"])
def test_the_kept_view_follows_feedback_rows_deleted_under_it(tmp_path, which):
    """Retention may delete feedback rows with their calls; the view then rebuilds (the newest row's rowid may even
    be given again to the next reward: SQLite reuses a deleted last rowid)."""
    from lightning_sdk.production.reward_log import RewardLog
    from tests.test_serve_reward_log import whole_log

    app = App(tmp_path / "serve.sqlite", seed=8)
    log = RewardLog(app.store, lightning_rl)
    try:
        app.traffic(60)
        log.refresh()
        db = sqlite3.connect(app.store.path)
        with db:
            # the newest alone: the next reward takes its rowid, so as many rows as read lie up to the cursor
            order, n = ("ASC", 5) if which == "oldest" else ("DESC", 1)
            db.execute(f"DELETE FROM feedback WHERE rowid IN (SELECT rowid FROM feedback ORDER BY rowid {order} "
                       f"LIMIT {n})")
        db.close()
        app.traffic(3)
        log.refresh()
        assert log.everything() == whole_log(app.ledger, app.store, lightning_rl)
        assert log.rebuilds == 1
    finally:
        log.close()
        app.close()


def test_feedback_rows_deleted_with_their_calls_are_forgotten_without_a_rebuild(tmp_path):
    """As retention prunes feedback rows with the calls they score: the samples are gone already, nothing else
    changes, so nothing is read again."""
    from lightning_sdk.production.retention import prune
    from lightning_sdk.production.reward_log import RewardLog
    from tests.test_serve_reward_log import DAY, whole_log

    app = App(tmp_path / "serve.sqlite", seed=9)
    log = RewardLog(app.store, lightning_rl)
    try:
        app.traffic(120)
        log.refresh()
        kept = app.ledger.count()
        done = prune(app.store.path, retention_s=DAY, max_calls=150, reward_name=None, now=app.now)
        gone = kept - app.ledger.count()  # retention deletes a reward with the last call it scores
        assert done.over_cap > 0 and done.feedback == gone
        app.traffic(10)
        read = log.spans_read
        log.refresh()
        assert gone > 0 and log.rebuilds == 0 and log.spans_read - read < 60
        assert log.everything() == whole_log(app.ledger, app.store, lightning_rl)
    finally:
        log.close()
        app.close()
