"""`lightning dashboard` names each eval score for what it is, in Chromium: a run whose data.eval is its training
file shows "score on the training tasks" with the standard error metrics.jsonl logged, a run from before
eval_split still says "eval"; and the stores `lightning eval` kept in a run's evals/ are listed and browsable,
read-only, by a name from that folder's listing only."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lightning_sdk.evals import EvalScore
from lightning_sdk.metrics import eval_row
from lightning_sdk.store import Store, seal
from tests.test_dashboard import js_fixed

CHROMIUM = "/usr/bin/chromium"
PROBE = '<img src=x onerror="window.__xss = 1">'
TASKS = {"a": {"id": "a", "question": "What is 1 + 1?", "answer": "2"},
         "b": {"id": "b", "question": "What is 2 + 2?", "answer": "4"},
         "c": {"id": "c", "question": "What is 3 + 3?", "answer": "6"}}
EVAL_FILE = "20261204T101500Z-iter2.sqlite"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")


def _rollouts(store: Store, phase: str, iteration: int, rewards: dict[str, float], prefix: str) -> None:
    for task_id, reward in rewards.items():
        rid = f"{prefix}-{task_id}"
        store.start_rollout(rid, task_id=task_id, group_id=rid, iteration=iteration, phase=phase)
        store.finish_rollout(rid, status="succeeded", output=f"{prefix} says {reward} {PROBE}", reward=reward)


def write_run(run: Path) -> list[dict]:
    """A 2-iteration run whose eval tasks are its training tasks (a, b, c), as `lightning run` leaves it, and one
    `lightning eval --trained` store in its evals/ (sealed, as the runtime leaves it)."""
    with Store(run / "store.sqlite") as store:
        store.add_tasks(TASKS.items())
        _rollouts(store, "eval", 0, {"a": 0.0, "b": 0.0, "c": 1.0}, "eval-untrained")
        _rollouts(store, "train", 1, {"a": 1.0, "b": 0.0, "c": 0.0}, "train-1")
        _rollouts(store, "train", 2, {"a": 1.0, "b": 1.0, "c": 0.0}, "train-2")
        _rollouts(store, "eval", 2, {"a": 1.0, "b": 1.0, "c": 0.0}, "eval-trained")
    rows = [eval_row("untrained", EvalScore.of([0.0, 0.0, 1.0], "train", 3), 0),
            {"iteration": 1, "reward_mean": 1 / 3, "reward_std": 0.47, "rollouts": 3},
            {"iteration": 2, "reward_mean": 2 / 3, "reward_std": 0.47, "rollouts": 3},
            eval_row("trained", EvalScore.of([1.0, 1.0, 0.0], "train", 3), 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = run / "evals" / EVAL_FILE
    with Store(db) as store:  # the eval of iter-00002 on tasks b (trained on) and d (never)
        store.add_tasks([("b", TASKS["b"]), ("d", {"id": "d", "question": "What is 4 + 4?", "answer": "8"})])
        _rollouts(store, "eval", 2, {"b": 1.0, "d": 0.5}, "kept")
    seal(db)
    return rows


def _files(run: Path) -> dict[str, str]:
    """Every file of evals/ (a sealed store read read-only leaves no -wal or -shm beside it), and the run's data
    files (a reader of the run's WAL store marks what it reads in its -shm)."""
    files = [*(run / "evals").iterdir(), run / "store.sqlite", run / "metrics.jsonl"]
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)}


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    rows = write_run(root / "ontrain")
    # a run from before eval_split: its eval rows carry no split, standard error or task count
    (root / "older").mkdir()
    (root / "older/metrics.jsonl").write_text(json.dumps({"phase": "eval", "eval": "untrained", "iteration": 0,
                                                          "eval.reward_mean": 0.25}) + "\n"
                                              + json.dumps({"iteration": 1, "reward_mean": 0.5}) + "\n")
    # a run whose eval rollouts mostly failed: the score is mostly zeros, and the page must say why
    (root / "failing").mkdir()
    failed = eval_row("untrained", EvalScore.of([0.0] * 19 + [1.0], "held-out", failed=19,
                                                failures=f"19 x RewardError: @reward returned None {PROBE}"), 0)
    (root / "failing/metrics.jsonl").write_text(json.dumps(failed) + "\n")
    before = _files(root / "ontrain")
    proc, where = launch(root)
    yield {**where, "rows": rows, "root": root, "before": before}
    proc.terminate()
    proc.wait(30)


def launch(root: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """`lightning dashboard --run-dir ROOT --port 0`, listening: the process, and its url, base and token."""
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(root),
                             "--port", "0"], env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    line = proc.stdout.readline()
    assert "http://127.0.0.1:" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
    url = line.split(" at ", 1)[1].split()[0]
    return proc, {"url": url, "base": url.split("/?", 1)[0], "token": url.split("token=", 1)[1]}


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, dashboard, where: str):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(dashboard["url"] + where)
    return page, errors


def _shots(tmp: Path) -> Path:
    d = Path(os.environ.get("DASHBOARD_SCREENSHOTS") or tmp)
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_an_eval_on_the_training_tasks_is_named_so_with_its_standard_error(dashboard, browser, tmp_path):
    untrained, trained = dashboard["rows"][0], dashboard["rows"][-1]
    page, errors = _open(browser, dashboard, "#/run/ontrain")
    page.wait_for_selector("tr.eval[data-iteration='2']")
    for row in (untrained, trained):
        tr = page.locator(f"tr.eval[data-iteration='{row['iteration']}']")
        assert tr.locator("td.words").text_content().startswith("score on the training tasks, ")
        assert tr.locator(".stderr").text_content() == f" ± {js_fixed(row['eval/stderr'])}"
        mean, err = js_fixed(row["eval/reward_mean"]), js_fixed(row["eval/stderr"])
        assert tr.locator("td").nth(2).text_content() == f"{mean} ± {err}"
    legend = page.locator("svg[aria-label='reward per iteration'] text.legend").all_text_contents()
    mean, err = js_fixed(trained["eval/reward_mean"]), js_fixed(trained["eval/stderr"])
    assert f"score on the training tasks after: {mean} ± {err} (3 tasks)" in legend
    assert not any(t.startswith(("eval ", "held-out")) for t in legend)
    page.screenshot(path=str(_shots(tmp_path) / "evals-run.png"), full_page=True)

    page.goto(dashboard["base"] + "/#/")
    page.wait_for_selector("tr[data-run=ontrain] td.eval-score")
    assert page.locator("tr[data-run=ontrain] td.eval-score").text_content() == (
        f"score on the training tasks after 2 iterations: {js_fixed(trained['eval/reward_mean'])} ± "
        f"{js_fixed(trained['eval/stderr'])} (3 tasks)")
    # a run from before eval_split: "eval", as it always said, and no standard error it never logged
    assert page.locator("tr[data-run=older] td.eval-score").text_content() == "eval before training: 0.250"
    # failed eval rollouts are said beside the score they pulled down, as text (the reason is the agent's)
    assert page.locator("tr[data-run=failing] td.eval-score").text_content().endswith(
        f"(20 tasks); 19 of 20 rollouts FAILED and scored 0: 19 x RewardError: @reward returned None {PROBE}")
    assert page.evaluate("window.__xss") is None and page.locator("img").count() == 0
    page.goto(dashboard["base"] + "/#/run/older")
    page.wait_for_selector("tr.eval")
    assert page.locator("tr.eval td.words").text_content() == "eval, before training"
    assert "eval before: 0.250" in page.locator("text.legend").all_text_contents()
    assert errors == []


def test_the_stores_lightning_eval_kept_are_listed_and_browsable_read_only(dashboard, browser, tmp_path):
    page, errors = _open(browser, dashboard, "#/run/ontrain")
    page.wait_for_selector(f".eval-stores tr[data-store='{EVAL_FILE}']")
    cells = page.locator(f".eval-stores tr[data-store='{EVAL_FILE}'] td").all_text_contents()
    score = EvalScore.of([1.0, 0.5], "mixed", 1)
    assert cells[:6] == [f"evals/{EVAL_FILE}", "2", score.words, js_fixed(score.mean), f"± {js_fixed(score.stderr)}", "2"]
    assert score.words == "score on tasks partly seen in training (1 of 2)"

    page.click(f".eval-stores tr[data-store='{EVAL_FILE}'] a.browse")
    page.wait_for_selector("tr.click[data-rollout='kept-d']")
    assert sorted(page.locator("tr.click").evaluate_all("rs => rs.map(r => r.dataset.rollout)")) == ["kept-b", "kept-d"]
    assert page.input_value("select[name=store]") == EVAL_FILE
    assert "store=" in page.url
    page.screenshot(path=str(_shots(tmp_path) / "evals-store.png"), full_page=True)

    page.click("tr.click[data-rollout='kept-d'] a")
    page.wait_for_selector("#output")
    assert page.locator("#output").text_content() == f"kept says 0.5 {PROBE}"
    assert page.locator("#store").text_content().startswith(f"from evals/{EVAL_FILE}")
    assert page.evaluate("window.__xss") is None and page.locator("img").count() == 0
    page.go_back()  # back to the eval store's list, not the run's
    page.wait_for_selector("tr.click[data-rollout='kept-b']")
    page.select_option("select[name=store]", "")
    page.wait_for_selector("tr.click[data-rollout='train-1-a']")
    assert page.locator("tr.click[data-rollout='kept-b']").count() == 0
    assert errors == []
    assert _files(dashboard["root"] / "ontrain") == dashboard["before"]  # browsing wrote nothing


def test_store_names_only_a_file_of_the_runs_evals(dashboard):
    base, token = dashboard["base"], dashboard["token"]
    with httpx.Client(base_url=base, cookies={f"lightning_dashboard_{base.rsplit(':', 1)[1]}": token}) as c:
        ok = c.get("/api/rollouts", params={"run": "ontrain", "store": EVAL_FILE}).json()
        assert sorted(r["rollout_id"] for r in ok["rows"]) == ["kept-b", "kept-d"]
        assert c.get("/api/rollout", params={"run": "ontrain", "id": "kept-b", "store": EVAL_FILE}).status_code == 200
        assert c.get("/api/rollout", params={"run": "ontrain", "id": "kept-b"}).status_code == 404
        for bad in ("../store.sqlite", "../x", "nope.sqlite", f"./{EVAL_FILE}", f"evals/{EVAL_FILE}",
                    str(dashboard["root"] / "ontrain/evals" / EVAL_FILE), "store.sqlite"):
            for path, extra in (("/api/rollouts", {}), ("/api/rollout", {"id": "kept-b"})):
                r = c.get(path, params={"run": "ontrain", "store": bad, **extra})
                assert r.status_code == 404, (bad, path, r.text)
