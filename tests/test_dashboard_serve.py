"""`lightning dashboard` over a `lightning serve --dir`: its versions in order (each update's candidate, the gate's
numbers, its canary's verdict, promoted / rejected / rolled back, when) and the live reward of each version that
served, mean ± standard error over rewarded episodes, from the JSON API and in Chromium. The store is written by the
production modules themselves (Store, FeedbackLedger, gate.record, canary.start/conclude, the learner's schema);
names and reasons are hostile markup, shown as text."""

import dataclasses
import hashlib
import json
import math
import os
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from lightning_sdk.dashboard import versions
from lightning_sdk.production import canary, gate, learner
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.store import Store
from tests.test_dashboard import js_fixed
from tests.test_dashboard_evals import launch
from tests.test_serve_canary import served

CHROMIUM = "/usr/bin/chromium"
PROBE = '<img src=x onerror="window.__xss = 1">'
BASE = f"base {PROBE}"  # the base model's served name, as the calls recorded it
V1, V2, V3 = "app-serve-v1", "app-serve-v2", "app-serve-v3"
# adapter -> episodes (trace id -> (calls, episode reward)); None: a call of no episode, rewarded 1 by its call id
EPISODES = {BASE: {"b1": (2, 1.0), "b2": (1, 0.0), "b3": (1, 0.0)},  # [1, 0, 0]
            V1: {"c1": (3, 1.0), "c2": (1, 1.0), "c3": (1, 0.0), None: (1, 1.0)},  # [1, 1, 0, 1]; per call 5/6
            V2: {"d1": (1, 0.0), "d2": (2, 0.5)}}  # [0, 0.5]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")


def trace(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def write_serve(d: Path) -> None:
    """What `lightning serve` with [learn] and a canary leaves: the base model served, v1 past the gate and its
    canary (promoted), v2 past the gate and rolled back by its canary, v3 rejected by the gate."""
    path, t0 = d / "serve.sqlite", time.time()
    store, n = Store(path), 0
    for adapter, episodes in EPISODES.items():
        for name, (calls, _) in episodes.items():
            for k in range(calls):
                n += 1
                served(store, f"{adapter[-2:]}{name}{k}", trace(name) if name else "", adapter, t0 + n)
    store.close()
    ledger = FeedbackLedger(path)
    for adapter, episodes in EPISODES.items():
        for name, (_, value) in episodes.items():
            ledger.give({"episode_id": trace(name), "value": value} if name else
                        {"call_id": f"{adapter[-2:]}None0", "value": value})
    ledger.close()
    db = sqlite3.connect(path)
    db.executescript(learner.SCHEMA)
    with db:
        for v in (1, 2, 3):
            db.execute("INSERT INTO learn_updates VALUES (?, ?, ?, ?, ?)", (v, t0 + 100 * v, f"app-serve-v{v}",
                       str(d / f"learn/v{v:06d}"),
                       # v3 from v1 (v2's canary was rolled back); v1 and v2 without a parent: the version before
                       json.dumps({"rewards": 4 * v, "calls": 3 * v, **({"parent": 1} if v == 3 else {})})))
    db.close()
    gate.record(path, gate.decide(V1, [1, 1, 0.5], BASE, [0, 1, 0], margin=0.1))  # lower +0.025: passed
    canary.start(path, V1, BASE, 0.5)
    canary.conclude(path, canary.judge(V1, [1, 1, 0, 1], BASE, [1, 0, 0], min_rewards=3, margin=0.5, z=1.645))
    gate.record(path, gate.decide(V2, [1, 1, 1], V1, [1, 1, 0.5], margin=0.2))  # lower -0.108: passed
    canary.start(path, V2, V1, 0.5)
    canary.conclude(path, canary.judge(V2, [0, 0.5], V1, [1, 1, 0, 1], min_rewards=2, margin=0.1, z=1.645))
    gate.record(path, gate.decide(V3, [0, 0, 1], V1, [1, 1, 1], margin=0.1))  # lower -1.215: rejected


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    (root / "serve").mkdir()
    write_serve(root / "serve")
    proc, where = launch(root)
    yield where
    proc.terminate()
    proc.wait(30)


# (mean, standard error, episodes) by hand: base 1, 0, 0; v1 1, 1, 0, 1 (sd 1/2); v2 0, 1/2 (sd sqrt(1/8))
LIVE = {BASE: (1 / 3, 1 / 3, 3), V1: (3 / 4, 1 / 4, 4), V2: (1 / 4, 1 / 4, 2)}


def test_the_api_gives_each_version_with_its_gate_canary_outcome_and_live_reward(dashboard):
    base, token = dashboard["base"], dashboard["token"]
    with httpx.Client(base_url=base, cookies={f"lightning_dashboard_{base.rsplit(':', 1)[1]}": token}) as c:
        assert [r["id"] for r in c.get("/api/runs").json()["runs"] if r["serve"]] == ["serve"]
        v = c.get("/api/summary", params={"run": "serve"}).json()["serve"]
    rows = {r["adapter"]: r for r in v["versions"]}
    assert [(r["version"], r["adapter"], r["outcome"]) for r in v["versions"]] == [
        (0, BASE, "base model"), (1, V1, "promoted after its canary"), (2, V2, "rolled back by its canary"),
        (3, V3, "rejected by the gate")]
    assert v["serving"] == V1 and v["reward_name"] == "reward"
    for adapter, (mean, se, n) in LIVE.items():
        live = rows[adapter]["live"]
        assert (live["mean"], live["stderr"], live["episodes"]) == (pytest.approx(mean), pytest.approx(se), n)
    assert rows[V3]["live"] is None  # never served
    g = rows[V1]["gate"]  # paired differences 1, 0, 0.5: mean 1/2, se sqrt(1/4 / 3)
    assert g["promoted"] and g["mean_difference"] == pytest.approx(0.5) and g["stderr"] == pytest.approx(
        math.sqrt(1 / 12)) and g["tasks"] == 3 and g["serving"] == BASE
    assert (g["candidate_mean"], g["serving_mean"]) == (pytest.approx(5 / 6), pytest.approx(1 / 3))
    k = rows[V2]["canary"]  # live 0, 1/2 against 1, 1, 0, 1: d = -1/2, se = sqrt(1/8 / 2 + 1/4 / 4)
    assert not k["promoted"] and k["mean_difference"] == pytest.approx(-0.5) and k["stderr"] == pytest.approx(
        math.sqrt(1 / 8)) and (k["canary_rewards"], k["serving_rewards"], k["share"]) == (2, 4, 0.5)
    assert not rows[V3]["gate"]["promoted"] and rows[V3]["canary"] is None
    assert (rows[V2]["calls"], rows[V2]["rewards"]) == (6, 8)
    assert [rows[v]["parent"] for v in (V1, V2, V3)] == [0, 1, 1]
    # a gate pass while a canary ran is stored as not promoted (promotion.Promoter.consider): said as such
    passed = dataclasses.replace(gate.decide(V3, [1, 1, 1], V1, [0, 0, 0], margin=0.1), promoted=False)
    assert versions.outcome(passed, None) == "passed the gate, not served (a canary was running)"
    assert versions.outcome(gate.decide(V3, [0, 0, 0], V1, [1, 1, 1], margin=0.1), None) == "rejected by the gate"
    assert rows[V2]["decided_at"] >= rows[V2]["canary"]["started_at"]


def test_the_page_shows_the_versions_and_the_live_reward_by_version(dashboard, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(dashboard["url"] + "#/run/serve")
        page.wait_for_selector(".versions tr[data-version='3']")
        assert page.locator("#serving").text_content() == V1
        outcomes = page.locator(".versions td.outcome").all_text_contents()
        assert outcomes == ["base model", "promoted after its canary", "rolled back by its canary",
                            "rejected by the gate"]
        assert page.locator(".versions tr[data-version='0'] td").nth(1).text_content() == BASE  # as text
        for adapter, (mean, se, n) in LIVE.items():
            cell = page.locator(f".versions tr[data-adapter='{adapter}'] td.live").text_content()
            assert cell == f"{js_fixed(mean)} ± {js_fixed(se)} ({n} episodes)"
        assert page.locator(".versions tr[data-version='3'] td.live").text_content() == "no reward yet"
        gate_cell = page.locator(".versions tr[data-version='1'] td.gate").text_content()
        assert gate_cell.startswith("passed 0.5000 ± 0.2887 (se), lower bound 0.0251 ≥ −margin -0.1000 over 3 eval")
        assert page.locator(".versions tr[data-version='2'] td.canary").text_content().startswith(
            "rolled back live -0.5000 ± 0.3536 (se), lower bound -1.0816 < −margin -0.1000: 2 against 4 rewarded")
        # the live reward chart: a point per version that served, at its mean (the chart's tooltips)
        points = page.locator(".versions .chart[data-key=live] circle title").all_text_contents()
        assert points == [f"live reward version {v}: {float(f'{m:.3g}'):g}" for v, (m, _, _) in
                          zip((0, 1, 2), LIVE.values())]
        assert page.locator(".versions .chart[data-key=live] path.band").count() == 1
        assert page.evaluate("window.__xss") is None and page.locator("img").count() == 0
        page.screenshot(path=str(Path(os.environ.get("DASHBOARD_SCREENSHOTS") or tmp_path) / "serve.png"),
                        full_page=True)
        assert errors == []
        browser.close()
