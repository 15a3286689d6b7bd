"""`lightning dashboard` over a run with [policies] (two adapters), in Chromium: each policy's numbers
(transitions.<policy>, train.<policy>.<key>) are curves of one chart per quantity, told apart by policy; and a run
written before config.json existed, whose configuration is read from the lightning.toml beside it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
POLICIES = {"solver": {"components": ["solver"]}, "judge": {"components": ["judge"]}}

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")


def write_run(run: Path) -> list[dict]:
    """A [policies] run's metrics.jsonl and config.json, as `lightning run` writes them (runtime.loop)."""
    run.mkdir(parents=True)
    rows = [{"iteration": n, "policy": f"solver=multi-solver-iter{n - 1}, judge=multi-judge-iter{n - 1}",
             "reward_mean": 0.2 * n, "reward_std": 0.1, "rollouts": 8, "failed": 0, "transitions": 12,
             "completion_tokens": 96, "collect_s": 1.5, "update_s": 0.5, "hotload_s": 0.1, "base_calls": 0,
             "transitions.solver": 8, "transitions.judge": 4 + n, "train.episode_reward_mean": 0.2 * n,
             "train.solver.loss": 0.1 / n, "train.judge.loss": 0.3 / n, "train.solver.grad_norm": 1.0 + n,
             "train.judge.grad_norm": 2.0 - 0.1 * n, "train.step": float(n)} for n in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"run": {"name": "multi"}, "policies": POLICIES,
                                                 "rollout": {"credit": "lightning_rl"}}))
    return rows


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    rows = write_run(root / "multi")
    # a run from before config.json: its lightning.toml beside it names it
    (root / "older").mkdir()
    (root / "older/metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (root / "lightning.toml").write_text('[run]\ndir = "older"\n[agent]\nmodule = "agent.py"\n[data]\n'
                                         'train = "train.jsonl"\n[train]\nlr = 5e-4\n[rollout]\ncredit = "last_call"\n')
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(root),
                             "--port", "0"], env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    line = proc.stdout.readline()
    assert "http://127.0.0.1:" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
    yield {"url": line.split(" at ", 1)[1].split()[0], "rows": rows, "root": root}
    proc.terminate()
    proc.wait(30)


def test_each_policy_is_a_curve_of_its_quantitys_chart(dashboard):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(dashboard["url"] + "#/run/multi")
            page.wait_for_selector(".chart")
            keys = page.locator(".chart").evaluate_all("cs => cs.map(c => c.dataset.key)")
            moved = {"train/episode_reward_mean", "train/step"}
            assert sorted(keys) == sorted(moved | {"rollout/transitions/*", "train/*/loss", "train/*/grad_norm"})
            # what every iteration logged alike is said in one line, not charted
            same = page.locator(".constants .constant").evaluate_all("cs => cs.map(c => c.dataset.key)")
            assert sorted(same) == sorted({"rollout/rollouts", "rollout/failed", "rollout/transitions",
                                           "rollout/completion_tokens", "time/collect_s", "time/update_s",
                                           "time/hotload_s", "rollout/base_calls", "tokens_per_completion"})
            for key in ("rollout/transitions/*", "train/*/loss", "train/*/grad_norm"):
                chart = page.locator(f".chart[data-key='{key}']")
                assert chart.locator(".legend .key").all_text_contents() == ["solver", "judge"]
                strokes = chart.locator("path.line").evaluate_all("ps => ps.map(p => p.getAttribute('stroke'))")
                assert len(strokes) == 2 and strokes[0] != strokes[1]
                assert chart.locator("circle").count() == 2 * len(dashboard["rows"])
            # the points are the policy's own values: the judge's loss at iteration 2 is 0.3 / 2
            titles = page.locator(".chart[data-key='train/*/loss'] circle title").all_text_contents()
            assert "judge iteration 2: 0.15" in titles and "solver iteration 3: 0.0333" in titles
            assert page.locator("h4:text-is('Per policy')").count() == 1
            assert errors == []
        finally:
            browser.close()


def test_a_run_without_config_json_shows_the_lightning_toml_beside_it(dashboard):
    from lightning_sdk import config

    base, token = dashboard["url"].split("/?token=")
    with httpx.Client(base_url=base, cookies={f"lightning_dashboard_{base.rsplit(':', 1)[1]}": token}) as c:
        s = c.get("/api/summary", params={"run": "older"}).json()
    defaults = config.effective(config.load(dashboard["root"] / "lightning.toml"))
    assert s["config_source"] == str(dashboard["root"] / "lightning.toml")
    assert s["config"]["train.lr"] == 5e-4 and s["config"]["train.clip_eps"] == defaults["train"]["clip_eps"]
    assert s["credit"]["rule"] == "last_call" and s["credit"]["source"] == s["config_source"]
