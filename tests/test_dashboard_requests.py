"""`lightning dashboard` over a run directory written here, asked with raw HTTP and shown in a browser: what a
request may hold (no control character), where a redirect may send the browser (this server only), and which
rollouts a checkpoint trained on (those of an iteration killed before its update are marked untrained)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest

from lightning_sdk.store import Store

CHROMIUM = "/usr/bin/chromium"
# A run killed during iteration 2's update, then resumed (as the runtime leaves it): iteration 1 trained into
# iter-00001; iteration 2's first collection is untrained, its second is being collected now.
ROLLOUTS = [("it1-a", 1, "succeeded"), ("it1-b", 1, "succeeded"), ("it1-c", 1, "failed"),
            ("it2-old-a", 2, "succeeded"), ("it2-old-b", 2, "succeeded"), ("it2-new-a", 2, "succeeded")]


def write_run(run: Path) -> None:
    with Store(run / "store.sqlite") as store:
        for rid, it, status in ROLLOUTS[:5]:
            store.start_rollout(rid, task_id="t", group_id=f"g{it}", iteration=it, phase="train")
            store.finish_rollout(rid, status=status, output="5", reward=1.0 if status == "succeeded" else None)
        assert store.mark_untrained(completed=1) == 2  # what resume does
        for rid, it, status in ROLLOUTS[5:]:
            store.start_rollout(rid, task_id="t", group_id=f"g{it}", iteration=it, phase="train")
            store.finish_rollout(rid, status=status, output="5", reward=0.0)
    history = [{"iteration": 1, "policy": "base", "reward_mean": 1.0, "reward_std": 0.0, "rollouts": 3, "failed": 1,
                "transitions": 2, "collect_s": 1.0, "update_s": 1.0}]
    (run / "checkpoints/iter-00001").mkdir(parents=True)
    (run / "checkpoints/iter-00001/state.json").write_text(json.dumps({"completed": 1, "history": history}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_run(root / "main")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(root),
                             "--port", "0"], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    line = proc.stdout.readline()
    assert "http://127.0.0.1:" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
    url = line.split(" at ", 1)[1].split()[0]
    base, token = url.split("/?", 1)[0], url.split("token=", 1)[1]
    yield {"base": base, "token": token, "root": root,
           "cookies": {f"lightning_dashboard_{base.rsplit(':', 1)[1]}": token}}
    proc.terminate()
    proc.wait(30)


@pytest.mark.parametrize("query, named", [
    ("run=main%00", "query parameter 'run'"), ("run=ma%0Ain", "query parameter 'run'"),
    ("run=main%7F", "query parameter 'run'"), ("run=main%C2%85", "query parameter 'run'"),
    ("run=main&component=a%1Fb", "query parameter 'component'"), ("run=main&x%00=1", "a query parameter's name")])
def test_a_control_character_in_a_query_is_a_400_naming_it(dashboard, query, named):
    with httpx.Client(base_url=dashboard["base"], cookies=dashboard["cookies"]) as c:
        assert c.get("/api/summary", params={"run": "main"}).status_code == 200
        for route in ("/api/summary", "/api/rollouts", "/"):
            r = c.get(f"{route}?{query}")
            assert r.status_code == 400 and r.text == f"{named}: holds a control character; expected plain text", \
                (route, query, r.status_code, r.text)
        assert c.get("/static/a%00b").status_code == 400
    # With the token in the URL too: refused, not redirected with the character in it.
    r = httpx.get(f"{dashboard['base']}/?token={dashboard['token']}&{query}")
    assert r.status_code == 400 and "location" not in r.headers


@pytest.mark.parametrize("path, location", [
    ("//evil.example/x", "/evil.example/x"), ("///evil.example/x", "/evil.example/x"),
    ("/%5Cevil.example/x", "/evil.example/x"), ("/%2F%2Fevil.example", "/evil.example"),
    ("/static/a%20b", "/static/a%20b"), ("/", "/")])
def test_a_redirect_stays_on_the_dashboard(dashboard, path, location):
    base = dashboard["base"]
    r = httpx.get(f"{base}{path}?token={dashboard['token']}&run=main")
    assert r.status_code == 303 and r.headers["location"] == f"{location}?run=main"
    assert urljoin(f"{base}{path}", r.headers["location"]).startswith(base + "/")  # where a browser goes


def test_the_api_says_which_rollouts_a_checkpoint_trained_on(dashboard):
    with httpx.Client(base_url=dashboard["base"], cookies=dashboard["cookies"]) as c:
        rows = c.get("/api/rollouts", params={"run": "main"}).json()["rows"]
        assert {r["rollout_id"]: (r["status"], r["checkpoint"]) for r in rows} == {
            "it1-a": ("succeeded", "iter-00001"), "it1-b": ("succeeded", "iter-00001"), "it1-c": ("failed", None),
            "it2-old-a": ("untrained", None), "it2-old-b": ("untrained", None), "it2-new-a": ("succeeded", None)}
        untrained = c.get("/api/rollouts", params={"run": "main", "status": "untrained"})
        assert untrained.status_code == 200 and untrained.json()["total"] == 2
        assert "iteration 2 was not trained" in untrained.json()["rows"][0]["error"]
        summary = c.get("/api/summary", params={"run": "main"}).json()
        assert [h["checkpoint"] for h in summary["history"]] == ["iter-00001"]
        assert summary["counts"] == {"succeeded": 3, "failed": 1, "untrained": 2}


def test_rollouts_sort_by_a_named_column_and_search_text_as_text(dashboard):
    with httpx.Client(base_url=dashboard["base"], cookies=dashboard["cookies"]) as c:
        def ids(**params):
            page = c.get("/api/rollouts", params={"run": "main", **params})
            assert page.status_code == 200, page.text
            return [r["rollout_id"] for r in page.json()["rows"]]

        assert c.get("/api/rollouts", params={"run": "main", "sort": "reward; DROP TABLE rollouts"}).status_code == 400
        # rewards 1.0 (it1-a, it1-b, it2-old-*), 0.0 (it2-new-a), none (it1-c): a missing reward comes last both ways
        assert ids(sort="reward", desc="false")[0] == "it2-new-a" and ids(sort="reward", desc="false")[-1] == "it1-c"
        assert ids(sort="reward")[-2:] == ["it2-new-a", "it1-c"]
        assert ids(sort="rollout", desc="false") == sorted(r[0] for r in ROLLOUTS)
        assert len(ids(q="5")) == 6 and ids(q="' OR 1=1 --") == [] and ids(q="%") == [] and ids(q="_") == []


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install -y "
                    "chromium)")
def test_the_page_lists_what_a_checkpoint_trained_on(dashboard, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{dashboard['base']}/?token={dashboard['token']}#/run/main")
            page.wait_for_selector("tr.click")
            assert page.locator(".badge.untrained").count() >= 2  # the counts line and the rows
            page.click("a.trained-on:text-is('iter-00001')")
            page.wait_for_selector(".pager >> text=1–2 of 2")
            shown = page.locator("tr.click").evaluate_all("rows => rows.map(r => r.dataset.rollout)")
            assert sorted(shown) == ["it1-a", "it1-b"]
            assert page.locator("select[name=status]").input_value() == "succeeded"
            assert page.locator("input[name=iteration]").input_value() == "1"
            cells = page.locator("tr[data-rollout='it1-a'] td").all_text_contents()
            assert cells[5] == "succeeded" and cells[-2] == "iter-00001"
            page.screenshot(path=str(tmp_path / "trained-on.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()


@pytest.mark.parametrize("name", ["offset", "iteration"])
def test_a_number_past_sqlite_s_integers_is_a_400_naming_it(dashboard, name):
    with httpx.Client(base_url=dashboard["base"], cookies=dashboard["cookies"]) as c:
        for value in ("1e20", str(2**63), "100000000000000000000"):
            r = c.get("/api/rollouts", params={"run": "main", name: value})
            assert r.status_code == 400 and r.text.startswith(name) and "\n" not in r.text, (value, r.text)
        assert c.get("/api/rollouts", params={"run": "main", name: str(2**63 - 1)}).status_code == 200


def test_connections_that_never_finish_their_headers_are_closed(dashboard):
    """Slowloris, bounded: 50 sockets each send half a request line and wait; the dashboard closes them all after
    its header timeout (15 s) and still serves."""
    import socket
    import time

    host, port = dashboard["base"].removeprefix("http://").rsplit(":", 1)
    socks = []
    for _ in range(50):
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(b"GET /api/runs HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the headers
        socks.append(s)
    start, closed = time.monotonic(), 0
    for s in socks:
        s.settimeout(max(0.1, 30 - (time.monotonic() - start)))
        try:
            closed += s.recv(1) == b""  # the server closed it
        except (TimeoutError, socket.timeout):
            pass
        finally:
            s.close()
    took = time.monotonic() - start
    assert closed == 50 and took < 25, (closed, took)
    assert httpx.get(dashboard["base"] + "/api/runs", cookies=dashboard["cookies"]).status_code == 200
