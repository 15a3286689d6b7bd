"""A canary under attack (issue 52, items 2 and 4). Item 2: rewards near the float limit (1.7e308, as a store made
before feedback was bounded may hold them) never stop a canary: the rule is computed in units of the largest
magnitude, a reward that adds up beyond float is left out and counted, the verdict's stored evidence is valid JSON,
a check that fails is said in one line once rather than a traceback each poll, and the dashboard's /api/summary for
that serve directory answers 200. Item 4: a real kill -9 (SIGKILL of the serving process, at the statement that
records the gate's pass, or at the canary's row, or at their commit) never leaves a restart serving the candidate to
all traffic without its canary. Real parts: the tiny model's CPU server and the gateway on 127.0.0.1, SQLite,
feedback through the ledger, GRPO steps, `lightning dashboard` as a child."""

import json
import logging
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from lightning_sdk.production import canary, deployment, gate, live_reward, promotion
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.store import Store
from tests.test_dashboard_evals import launch
from tests.test_serve_canary import always_passes, episodes, rewards, served
from tests.test_serve_learn import project, reward_all, traffic

HUGE = 1.7e308
ROOT = Path(__file__).resolve().parents[1]


def huge(path: Path, feedback_id: str, value: float = HUGE) -> None:
    """A stored reward set to `value` as an old store may hold it (the ledger of today may refuse it when given)."""
    db = sqlite3.connect(path)
    with db:
        assert db.execute("UPDATE feedback SET value=? WHERE feedback_id=?", (value, feedback_id)).rowcount == 1
    db.close()


def strict(text: str):
    """JSON as a browser parses it: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in stored JSON"))


def test_huge_rewards_neither_raise_nor_stop_the_canarys_verdict(tmp_path):
    path, since = tmp_path / "serve.sqlite", time.time()
    store = Store(path)
    calls = {"h1": ("h" * 32, "c"), "h2": ("h" * 32, "c"),  # one episode of 2 calls, rewarded 1.7e308
             "i1": ("i" * 32, "c"),  # rewarded 1.7e308 twice: its rewards add up beyond float (inf)
             "a1": ("a" * 32, "c"), "b1": ("b" * 32, "c"), "e1": ("e" * 32, "c"),
             "s1": ("1" * 32, "s"), "s2": ("2" * 32, "s"), "s3": ("3" * 32, "s"), "s4": ("4" * 32, "s")}
    for n, (span, (episode, adapter)) in enumerate(calls.items()):
        served(store, span, episode, adapter, since + 1 + n)
    store.close()
    ledger = FeedbackLedger(path)
    given = {"h": 0.0, "i": 0.0, "a": 1.0, "b": 0.0, "e": 1.0, "1": 1.0, "2": 0.0, "3": 1.0, "4": 0.0}
    for e, value in given.items():
        ledger.give({"episode_id": e * 32, "value": value, "feedback_id": f"f{e}"})
    ledger.give({"episode_id": "i" * 32, "value": 0.0, "feedback_id": "fi2"})
    ledger.close()
    for feedback_id in ("fh", "fi", "fi2"):
        huge(path, feedback_id)
    live = live_reward.by_adapter(path, "reward", since=since)  # main: OverflowError (fmean of the 2-call episode)
    assert sorted(live["c"]) == [0.0, 1.0, 1.0, HUGE, math.inf] and sorted(live["s"]) == [0.0, 0.0, 1.0, 1.0]
    v = canary.judge("c", live["c"], "s", live["s"], min_rewards=3, margin=0.5, z=1.645)
    assert (v.canary_rewards, v.serving_rewards, v.left_out) == (4, 4, 1)  # the inf episode left out, counted
    assert v.canary_mean == pytest.approx(HUGE / 4) and v.serving_mean == 0.5
    assert v.mean_difference == pytest.approx(HUGE / 4) and v.stderr == pytest.approx(HUGE / 4)
    assert not v.promoted and "1 episode reward(s) not finite, left out" in v.reason  # lower bound -0.645 x HUGE/4
    # on the serving side the same: a huge serving reward rolls the canary back, a huge canary spread too
    assert not canary.judge("c", [1.0, 0.0, 1.0], "s", [HUGE, 0.0, 0.0], min_rewards=3, margin=0.5, z=1.645).promoted
    w = canary.judge("c", [HUGE, -HUGE, 0.0], "s", [0.0, 1.0, 0.0], min_rewards=3, margin=0.5, z=1.645)
    assert not w.promoted and w.mean_difference == pytest.approx(-1 / 3)
    # ordinary rewards: the numbers are exactly those of the plain formula
    u = canary.judge("c", [1.0, 1.0, 0.0], "s", [0.0, 1.0, 0.0], min_rewards=3, margin=0.5, z=1.645)
    assert u.mean_difference == pytest.approx(1 / 3) and u.stderr == pytest.approx(math.sqrt(2 / 9)) and u.promoted
    s = live_reward.summarize("c", live["c"])  # main: OverflowError (statistics.stdev)
    assert (s.mean, s.stderr, s.episodes) == (pytest.approx(HUGE / 4), pytest.approx(HUGE / 4), 4)
    assert live_reward.summarize("x", [HUGE, -HUGE]).stderr == pytest.approx(HUGE)
    canary.start(path, "c", "s", 0.5)
    # d = -HUGE, lower bound -2.2 x HUGE: beyond float, stored as null
    canary.conclude(path, canary.judge("c", [-HUGE, -HUGE, HUGE], "s", [HUGE, HUGE, 0.0], min_rewards=3, margin=0.5,
                                       z=1.645))
    db = sqlite3.connect(path)
    evidence = strict(db.execute("SELECT evidence FROM canaries").fetchone()[0])  # main: Infinity in the JSON
    db.close()
    assert evidence["lower_bound"] is None and evidence["canary_mean"] == pytest.approx(-HUGE / 3)
    assert evidence["promoted"] is False and evidence["mean_difference"] == pytest.approx(-HUGE)


def canary_deployment(folder: Path):
    """`lightning serve` with [learn] in `folder`: a gate that passes every candidate, then a canary of half the
    new episodes deciding after 3 rewarded episodes a side, within a margin of 0.5."""
    cfg = project(folder, every=4)
    cfg.learn.canary_share, cfg.learn.canary_min_rewards, cfg.learn.gate_margin = 0.5, 3, 0.5
    return deployment.start(cfg, folder / "serve", host="127.0.0.1", port=0, api_key=None, retention_s=3600,
                            scorer=always_passes)


def canary_running(tmp_path, salt: str = "a"):
    """A deployment whose v1 passed the gate and serves half of new episodes as a canary; its episodes (canary,
    serving)."""
    dep = canary_deployment(tmp_path)
    first = traffic(dep, 4)
    dep.gateway.capture.flush()
    reward_all(dep, first)
    dep.schedule.run_once()
    assert dep.gateway.canary == ("app-serve-v1", 0.5)
    return dep, *episodes(dep, salt, 16)


def test_a_huge_reward_during_a_canary_is_read_and_the_canary_decides_with_one_line_for_a_failed_check(
        tmp_path, caplog, monkeypatch):
    dep, on_canary, on_serving = canary_running(tmp_path)
    caplog.set_level(logging.INFO, logger="lightning_sdk")
    # the canary's poll alone: the update these rewards would make due reads the same huge rewards (items 1 and 3)
    dep.schedule.learner.learn.every_rewarded = 10**6
    try:
        # the attack: a 1.7e308 episode reward on each side, given twice on one canary episode (beyond float)
        rewards(dep, [on_canary[0], on_serving[0]], [0, 0], "x")
        dep.ledger.give({"episode_id": on_canary[0], "value": 0.0, "feedback_id": "again"})
        for feedback_id in (f"x{on_canary[0]}", "again", f"x{on_serving[0]}"):
            huge(dep.store.path, feedback_id)
        assert dep.schedule.run_once() is None and dep.gateway.canary == ("app-serve-v1", 0.5)  # 0 finite: runs on
        # honest rewards after it are read, and the canary decides (the huge serving reward rolls it back)
        rewards(dep, on_canary[1:4], [1, 1, 1], "y")
        rewards(dep, on_serving[1:4], [0, 0, 0], "y")
        dep.schedule.run_once()  # main: OverflowError (statistics.variance), and so at every poll
        kept = canary.history(dep.store.path)
        assert kept[-1]["promoted"] is False and kept[-1]["evidence"]["left_out"] == 1
        assert (kept[-1]["evidence"]["canary_rewards"], kept[-1]["evidence"]["serving_rewards"]) == (3, 4)
        assert dep.gateway.canary is None and dep.gateway.policy == "builtin:tiny-arith"
        # a check that fails (here: the store busy for 3 polls) is one line, said once, and the poll goes on
        real, fails = dep.schedule.promoter.check_canary, iter([True, True, True])

        def busy():
            if next(fails, False):
                raise sqlite3.OperationalError("database is locked")
            return real()

        monkeypatch.setattr(dep.schedule.promoter, "check_canary", busy)
        for _ in range(5):
            assert dep.schedule.run_once() is None
        said = [r for r in caplog.records if "canary" in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(said) == 1 and said[0].exc_info is None and "database is locked" in said[0].getMessage()
        assert not [r for r in caplog.records if r.exc_info]  # no traceback anywhere
    finally:
        dep.close()


def test_the_dashboard_summary_of_a_serve_directory_with_huge_rewards_answers(tmp_path):
    root = tmp_path / "runs"
    (root / "serve").mkdir(parents=True)
    path, t0 = root / "serve" / "serve.sqlite", time.time()
    store = Store(path)
    for n, (trace, adapter) in enumerate([("a", "v1"), ("b", "v1"), ("c", "v1"), ("d", "base"), ("e", "base")]):
        served(store, f"s{trace}", trace * 32, adapter, t0 + n)
    store.close()
    ledger = FeedbackLedger(path)
    for trace in "abcde":
        ledger.give({"episode_id": trace * 32, "value": 1.0, "feedback_id": f"f{trace}"})
    ledger.close()
    huge(path, "fa")
    huge(path, "fb")  # the sums are beyond float: the adapter's episodes are read again (main: fmean's overflow)
    canary.start(path, "v1", "base", 0.5)
    proc, where = launch(root)
    try:
        base, token = where["base"], where["token"]
        with httpx.Client(base_url=base, cookies={f"lightning_dashboard_{base.rsplit(':', 1)[1]}": token}) as c:
            got = c.get("/api/summary", params={"run": "serve"})
        assert got.status_code == 200, got.text[:300]  # main: 500 (statistics.fmean: intermediate overflow)
        rows = {r["adapter"]: r for r in got.json()["serve"]["versions"]}
        # v1: 1.7e308, 1.7e308, 1: mean 2/3 x 1.7e308, sample sd 1.7e308 / sqrt(3), standard error 1.7e308 / 3
        assert rows["v1"]["live"]["episodes"] == 3 and rows["v1"]["live"]["mean"] == pytest.approx(HUGE / 3 * 2)
        assert rows["v1"]["live"]["stderr"] == pytest.approx(HUGE / 3)
        assert rows["base"]["live"]["mean"] == 1.0
    finally:
        proc.terminate()
        proc.wait(30)


CHILD = textwrap.dedent('''
    import os, signal, sqlite3, sys
    from pathlib import Path
    from tests.test_serve_canary_attacks import canary_deployment
    from tests.test_serve_learn import reward_all, traffic

    folder, kill_at = Path(sys.argv[1]), sys.argv[2]
    armed = []  # the gate's pass was written (committed or not): from then on, kill at `kill_at`

    class KilledAt(sqlite3.Connection):
        """kill -9 of this process right after the first statement starting with `kill_at` that runs once the gate's
        pass was written (that statement itself included)."""
        def execute(self, sql, *args):
            cursor = super().execute(sql, *args)
            said = " ".join(sql.split()).upper()
            if said.startswith("INSERT INTO PROMOTIONS"):
                armed.append(self)
            # a COMMIT: that of the pass's own connection; another statement: the first after the pass
            if (self in armed if kill_at == "COMMIT" else armed) and said.startswith(kill_at):
                os.kill(os.getpid(), signal.SIGKILL)
            return cursor

    dep = canary_deployment(folder)
    first = traffic(dep, 4)
    dep.gateway.capture.flush()
    reward_all(dep, first)
    connect = sqlite3.connect
    sqlite3.connect = lambda *a, **k: connect(*a, factory=KilledAt, **k)
    dep.schedule.run_once()
    sqlite3.connect = connect
    print("not killed: the statement never ran", flush=True)
    dep.close()
''')


@pytest.mark.parametrize("kill_at", ["INSERT INTO PROMOTIONS", "INSERT INTO CANARIES", "COMMIT"])
def test_a_kill_9_between_the_gates_pass_and_the_canarys_row_never_serves_the_candidate_to_all(tmp_path, kill_at):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), kill_at], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=300)
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # whatever it started, if anything outlived it
        except ProcessLookupError:
            pass
    assert child.returncode in (-signal.SIGKILL, 0), out[-3000:]
    killed = child.returncode == -signal.SIGKILL
    assert killed or kill_at == "COMMIT", out[-3000:]  # (main writes the two rows with no COMMIT statement)
    dep = canary_deployment(tmp_path)
    try:
        passed = [d.candidate for d in gate.decisions(dep.store.path) if d.promoted]
        # main, killed after the pass's row: app-serve-v1 serves all traffic and never gets a canary
        assert dep.gateway.policy == "builtin:tiny-arith", (kill_at, killed, dep.gateway.policy)
        assert promotion.last_promoted(dep.store.path) is None
        if passed:  # the pass was stored: so was its canary, and the restart resumes it
            assert dep.gateway.canary == ("app-serve-v1", 0.5) and canary.running(dep.store.path) is not None
            assert dep.schedule.promoter.in_service() == 1
        else:  # killed before the commit: nothing of the decision stored, the base model serves on
            assert killed and dep.gateway.canary is None and canary.history(dep.store.path) == []
            assert dep.schedule.promoter.in_service() == 0
    finally:
        dep.close()
