"""`lightning dashboard` as a reader of charts expects it, in Chromium: every y-axis label whole inside its chart
(a loss of -0.00783 is not clipped to 0.00783), ticks at 1, 2 or 5 x 10^k, the reward's std band within the
rewards' range, a metric that never changed said in a line and one never measured not charted, words for every
key, the rollout counts labelled, a stopped run's status and reason, and the settings count matching its rows.
And the advantage the rollout page explains is the trainer's, with scale_rewards = "batch" and
drop_zero_variance_groups = true."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdk.advantage import STD_EPS
from lightning_sdk.dashboard.explain import Scoring, explain
from lightning_sdk.credit import resolve
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import COMPLETION_IDS, COMPLETION_LOGPROBS, PROMPT_IDS, SpanRecord

CHROMIUM = "/usr/bin/chromium"
LOSS = [-0.00783, 0.0121, -0.0031, 0.0046]


def call(rollout_id: str, i: int) -> SpanRecord:
    """The gateway's record of one LLM call (what to_transitions reads)."""
    return SpanRecord(span_id=f"{i:016x}", trace_id="0" * 31 + "1", parent_id=None, rollout_id=rollout_id, attempt=1,
                      component=None, name="chat m", start_ns=i * 10, end_ns=i * 10 + 5, status="OK",
                      status_message=None, source="gateway",
                      attributes={"gen_ai.operation.name": "chat", PROMPT_IDS: [1, 2], COMPLETION_IDS: [3, 4],
                                  COMPLETION_LOGPROBS: [-0.5, -0.5]})


def write_store(path: Path, rewards: dict[str, list[float]], iteration: int = 0) -> Store:
    store = Store(path)
    n = 0
    for g, rs in rewards.items():
        for k, r in enumerate(rs):
            rid = f"{g}-{k}"
            store.start_rollout(rid, task_id=g, group_id=g, iteration=iteration, phase="train", attempt=1, model="m")
            store.finish_rollout(rid, status="succeeded", output="out", reward=r)
            store.write_calls([call(rid, n)])
            n += 1
    return store


def write_run(run: Path, config: dict, outcome: dict | None, *, kl: bool = True) -> None:
    run.mkdir(parents=True)
    rows = [{"iteration": n + 1, "policy": "p", "reward_mean": 0.5, "reward_std": 0.6, "rollouts": 8, "failed": 0,
             "transitions": 8, "completion_tokens": 40 + n, "collect_s": 1.0 + n, "update_s": 0.5,
             "train.loss": LOSS[n], "train.kl": 0.0, "train.never": None, "train.adv_std": 0.9 + 0.01 * n}
            for n in range(4)]
    if not kl:  # train.beta = 0: the trainer logs no KL
        rows = [{k: v for k, v in r.items() if k != "train.kl"} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps(config))
    if outcome is not None:
        (run / "outcome.json").write_text(json.dumps(outcome))
    write_store(run / "store.sqlite", {"g0": [0.0, 1.0, 1.0, 0.0], "g1": [1.0, 1.0, 0.0, 1.0]}).close()


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed")
    root = tmp_path_factory.mktemp("runs")
    base = {"run": {"name": "a", "dir": str(root / "a")}, "train": {"lr": 2e-3, "beta": 0.0, "epochs": 2}}
    write_run(root / "a", base, {"status": "stopped", "reason": "iteration 4: 5 of 8 rollouts failed", "pid": 1})
    write_run(root / "b", {"run": {"name": "b", "dir": str(root / "b")}, "train": {"lr": 1e-3, "beta": 0.0,
                                                                                 "epochs": 1}}, None, kl=False)
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(root),
                             "--port", "0"], env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    line = proc.stdout.readline()
    assert "http://127.0.0.1:" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield {"url": line.split(" at ", 1)[1].split()[0], "page": page, "errors": errors}
        browser.close()
    proc.terminate()
    proc.wait(30)


def ticks(chart) -> list[dict]:
    """Each y tick label: its text, and whether its box lies inside the chart's svg."""
    return chart.locator("svg text.tick").evaluate_all(
        "ts => ts.map(t => { const b = t.getBBox(); return {text: t.textContent, x: b.x, right: b.x + b.width}; })")


def nice(values: list[float]) -> bool:
    steps = {round(b - a, 12) for a, b in zip(values, values[1:])}
    if len(steps) != 1:
        return False
    (step,) = steps
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5))


def test_axes_bands_and_which_charts(dashboard):
    page = dashboard["page"]
    page.goto(dashboard["url"] + "#/run/a")
    page.wait_for_selector(".chart")
    loss = page.locator(".chart[data-key='train/loss']")
    labels = ticks(loss)
    assert all(t["x"] >= 0 for t in labels), labels  # no label starts left of the chart: none is clipped
    values = [float(t["text"]) for t in labels]
    assert min(values) <= min(LOSS) and max(values) >= max(LOSS) and nice(values), values
    assert any(t["text"].startswith("-") for t in labels)
    # every chart's ticks are nice, and every chart is titled in words
    for key in page.locator(".chart").evaluate_all("cs => cs.map(c => c.dataset.key)"):
        chart = page.locator(f".chart[data-key='{key}']")
        assert nice([float(t["text"]) for t in ticks(chart)]), key
        title = chart.locator(".title").text_content()
        assert "." not in title and "_" not in title, title
    # KL logged as 0.0 every iteration is said once, not charted; a key never measured is nowhere
    keys = set(page.locator(".chart").evaluate_all("cs => cs.map(c => c.dataset.key)"))
    assert keys == {"train/loss", "train/adv_std", "rollout/completion_tokens", "time/collect_s",
                    "tokens_per_completion"}
    constants = page.locator(".constants .constant")
    assert set(constants.evaluate_all("cs => cs.map(c => c.dataset.key)")) == {
        "train/kl", "rollout/rollouts", "rollout/failed", "rollout/transitions", "time/update_s"}
    assert "KL to the reference 0" in constants.all_text_contents()
    assert "train.never" not in page.content() and "train/never" not in page.content()
    # 0.5 ± 0.6 of rewards that are 0 or 1: the band stays within 0 and 1
    reward = page.locator("svg[aria-label='reward per iteration']")
    y = {t.text_content(): float(t.get_attribute("y")) - 4 for t in reward.locator("text.tick").all()}
    box = reward.locator("path.band").evaluate("p => { const b = p.getBBox(); return [b.y, b.y + b.height]; }")
    assert y["1.0"] - 0.5 <= box[0] and box[1] <= y["0"] + 0.5, (y, box)
    assert box[0] <= y["1.0"] + 0.5 and box[1] >= y["0"] - 0.5  # and reaches both (0.5 ± 0.6 is clipped, not cut)
    assert "KL" in page.locator("table th").all_text_contents()  # measured (as 0): a column
    # the counts are labelled, and a stopped run says so and why
    counts = page.locator(".counts").inner_text()
    assert "rollouts: succeeded 8" in counts.replace("\n", " ").replace("  ", " ")
    assert "stopped" in counts and "iteration 4: 5 of 8 rollouts failed" in counts
    assert dashboard["errors"] == []


def test_runs_list_says_each_runs_status_and_compare_counts_its_rows(dashboard):
    page = dashboard["page"]
    page.goto(dashboard["url"] + "#/")
    page.wait_for_selector("tr[data-run='a']")
    assert "stopped" in page.locator("tr[data-run='a'] td.status").inner_text()
    assert "iteration 4: 5 of 8 rollouts failed" in page.locator("tr[data-run='a'] td.status").inner_text()
    assert "unknown" in page.locator("tr[data-run='b'] td.status").inner_text()
    # a column no iteration has a value for is left out of the iteration table (run b logged no KL)
    page.goto(dashboard["url"] + "#/run/b")
    page.wait_for_selector("th:text-is('loss')")
    headers = page.locator("table th").all_text_contents()
    assert "loss" in headers and "KL" not in headers, headers
    page.goto(dashboard["url"] + "#/compare/a/b")
    page.wait_for_selector(".config-diff tbody tr")
    rows = page.locator(".config-diff tbody tr").evaluate_all("rs => rs.map(r => r.dataset.key)")
    assert rows == ["train.epochs", "train.lr"]
    assert page.locator(".diff-count").text_content() == "2 settings differ"
    assert "run.dir" in page.locator(".own").text_content()
    assert dashboard["errors"] == []


def test_the_page_explains_the_trainers_advantage_with_batch_std_and_dropped_groups(tmp_path):
    """16 groups of 8, 6 of them all-equal: the trainer drops those before the batch's std; so does the page."""
    rewards = {f"g{g:02d}": ([float(g % 2)] * 8 if g < 6 else [float((g * 7 + k * 3) % 5 == 0) + 0.1 * (k % 3)
                                                                for k in range(8)]) for g in range(16)}
    store = write_store(tmp_path / "store.sqlite", rewards)
    s = Scoring(resolve("lightning_rl"), "lightning_rl", (), -1.0, "batch", drop_zero_variance=True)
    live = [r for g, rs in rewards.items() if g >= "g06" for r in rs]
    mean = sum(live) / len(live)
    batch_std = math.sqrt(sum((r - mean) ** 2 for r in live) / (len(live) - 1)) + STD_EPS
    for g in ("g07", "g12"):
        rs = rewards[g]
        record = store.rollout(f"{g}-1")
        explained = explain(store, record, s)
        (a,) = explained.advantages.values()
        assert a.divisor == pytest.approx(batch_std)
        assert a.value == pytest.approx((rs[1] - sum(rs) / 8) / batch_std)
    dropped = explain(store, store.rollout("g02-0"), s)
    assert dropped.advantages == {} and "drop_zero_variance_groups" in dropped.note
    store.close()
