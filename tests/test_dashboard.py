"""`lightning dashboard` in a real browser (Playwright driving Debian's chromium) over a real, short `lightning run`.

The run is watched live: its first rollout waits for a gate file, so the page is loaded while the run is under
way, and the iterations and the eval after training appear without a reload. Agent text is hostile: a task's
question, a tool's error and (written into the store afterwards) a completion carry script probes, and the test
checks they are shown as text and never run. Screenshots go to $DASHBOARD_SCREENSHOTS (docs/dashboard/ for the
docs), else to the test's tmp dir.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from lightning_sdk.store import Store

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
PROBE = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed "
                                "(.ci/run installs it: apt-get install -y chromium)")

AGENT = '''
import asyncio
import pathlib

from openai import AsyncOpenAI
from opentelemetry import trace

import lightning_sdk as ls

GATE = pathlib.Path(__file__).with_name("go")
tracer = trace.get_tracer("test-agent")
_first = [True]


@ls.rollout
async def solve(task: dict, llm: ls.LLM) -> str:
    if _first[0]:  # hold the run until the test has the page open
        _first[0] = False
        while not GATE.exists():
            await asyncio.sleep(0.1)
    with ls.component("solver"):
        async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
            out = await client.chat.completions.create(
                model=llm.model, temperature=1.0, max_tokens=6,
                messages=[{"role": "system", "content": "Answer with a number."},
                          {"role": "user", "content": task["question"]}])
    text = out.choices[0].message.content or ""
    with tracer.start_as_current_span("tool.check", attributes={"tool.input": text}) as span:
        span.set_attribute("tool.output", str(text.strip().isdigit()))
    ls.emit_reward(0.5, "format")
    if "<script>" in task["question"]:
        try:
            with tracer.start_as_current_span("tool.flaky"):
                raise RuntimeError("flaky tool failed on " + task["question"])
        except RuntimeError:
            pass
    return text


@ls.reward
def score(task: dict, output: str) -> float:
    return float(output.strip() == task["answer"])
'''


def _shots(tmp: Path) -> Path:
    d = Path(os.environ.get("DASHBOARD_SCREENSHOTS") or tmp)
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("dash")
    (d / "agent.py").write_text(AGENT)
    (d / "train.jsonl").write_text(json.dumps({"id": "probe", "question": f"What is 2 + 3? {PROBE}", "answer": "5"})
                                   + "\n" + json.dumps({"id": "4+4", "question": "What is 4 + 4?", "answer": "8"}) + "\n")
    (d / "eval.jsonl").write_text(json.dumps({"id": "1+2", "question": "What is 1 + 2?", "answer": "3"}) + "\n")
    (d / "lightning.toml").write_text("""
[run]
name = "dash"
dir = "runs/main"
iterations = 2
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
tasks_per_iteration = 2
group_size = 2
[model]
name = "builtin:tiny-arith"
dtype = "float32"
[rollout]
concurrency = 4
timeout = 600
credit = "last_call"
[train]
lr = 2e-3
lora_r = 8
target_modules = ["all-linear", "lm_head"]
micro_batch_size = 8
""")
    return d


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    return subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def live(project):
    """`lightning run` under way (held at its first rollout) and `lightning dashboard` over its runs folder."""
    run = _cli("run", cwd=project)
    (project / "runs").mkdir(exist_ok=True)
    dash = _cli("dashboard", "--run-dir", "runs", "-c", "lightning.toml", "--port", "0", cwd=project)
    line = dash.stdout.readline()
    assert "http://127.0.0.1:" in line, line + (dash.stdout.read() if dash.poll() is not None else "")
    url = line.split(" at ", 1)[1].split()[0]
    yield {"url": url, "base": url.split("/?", 1)[0], "token": url.split("token=", 1)[1], "run": run,
           "dir": project / "runs/main"}
    for p in (run, dash):
        if p.poll() is None:
            p.terminate()
            p.wait(30)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _finish(live, project) -> None:
    """Open the gate the run's first rollout waits at, and wait for the run to end."""
    (project / "go").touch()
    if live["run"].returncode is None:
        out, _ = live["run"].communicate(timeout=600)
        assert live["run"].returncode == 0, out


def _digest(run_dir: Path) -> dict[str, str]:
    # The shared-memory index (-shm) is where every WAL reader marks what it reads; the data files must not change.
    return {n: hashlib.sha256((run_dir / n).read_bytes()).hexdigest() for n in ("store.sqlite", "store.sqlite-wal",
                                                                               "metrics.jsonl") if (run_dir / n).exists()}


def test_dashboard_in_a_browser(live, project, browser, tmp_path):
    shots = _shots(tmp_path)
    page = browser.new_page(viewport={"width": 1200, "height": 860})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(live["url"] + "#/run/main")
    assert "token=" not in page.url  # the key moved into a cookie and out of the address bar

    # While the run is held at its first rollout: no iteration yet, a rollout shown running, marked live.
    page.wait_for_selector(".badge.live", timeout=300_000)
    assert page.locator("text=No iteration finished yet.").count() == 1
    assert live["run"].poll() is None

    _finish(live, project)  # the open page must follow the run by polling alone
    page.wait_for_function("document.querySelectorAll('tr.eval').length === 2 && "
                           "[...document.querySelectorAll('td')].some(td => td.textContent === 'dash-iter1')",
                           timeout=60_000)
    iter_rows = page.locator("h3:text('Iterations') + div tbody tr")
    assert iter_rows.count() == 4  # eval before, iterations 1 and 2, eval after
    metrics = [r for r in map(json.loads, (live["dir"] / "metrics.jsonl").read_text().splitlines())
               if r.get("phase") != "eval"]  # the iteration rows
    assert iter_rows.nth(2).locator("td").nth(2).text_content() == f"{metrics[1]['reward_mean']:.3f}"
    assert page.locator("svg[aria-label='reward per iteration'] circle").count() == 2
    page.wait_for_selector("td:text-is('eval after')")
    page.screenshot(path=str(shots / "run.png"), full_page=True)

    before = _digest(live["dir"])
    with Store(live["dir"] / "store.sqlite", read_only=True) as store:
        probe_rollout = next(r for r in store.rollouts(phase="train", iteration=1) if r.task_id == "probe")
        spans = store.spans(probe_rollout.rollout_id)
    call = next(s for s in spans if s.source == "gateway")  # the gateway's record of the call
    completion = json.loads(call.attributes["gen_ai.output.messages"])[0]["parts"][0]["content"]

    cells = page.locator(f"tr[data-rollout='{probe_rollout.rollout_id}'] td").all_text_contents()
    assert cells[5:7] == ["1", str(len(spans))]  # LLM calls, all spans

    # Into one rollout: its timeline shows the prompt messages, the completion, the tool spans, the error.
    page.click(f"tr[data-rollout='{probe_rollout.rollout_id}'] a")
    page.wait_for_selector(".span.llm")
    llm = page.locator(".span.llm")
    prompt = [t.strip() for t in llm.locator(".cols > div").nth(0).locator("pre").all_text_contents()]
    assert prompt == ["Answer with a number.", f"What is 2 + 3? {PROBE}"]
    assert llm.locator(".cols > div").nth(1).locator("pre").all_text_contents() == [completion]
    assert f"{len(call.attributes['lightning.llm.prompt_token_ids'])} → " \
           f"{len(call.attributes['lightning.llm.completion_token_ids'])} tokens" in llm.text_content()
    # last_call credits the episode reward to the (only) call, plus its intermediate rewards: +0.5 emitted,
    # -1 (rollout.error_reward) for the failed tool span.
    assert f"credited reward {probe_rollout.reward + 0.5 - 1.0:.3f}" in llm.text_content()
    assert page.locator(".span.tool").count() == 2 and page.locator(".span.reward").count() == 1
    flaky = page.locator(".span.error")
    assert flaky.count() == 1 and f"flaky tool failed on What is 2 + 3? {PROBE}" in flaky.text_content()
    assert page.locator("#output").text_content() == completion
    assert page.evaluate("window.__xss") is None
    assert page.locator("script").count() == 1 and page.locator("img").count() == 0  # app.js only; no probe img
    page.screenshot(path=str(shots / "rollout.png"), full_page=True)
    assert _digest(live["dir"]) == before  # browsing wrote nothing

    # A completion that is itself a script probe (recorded as the gateway would have, had the server returned it).
    with Store(live["dir"] / "store.sqlite") as store:
        rid = "probe-completion"
        store.start_rollout(rid, task_id="probe", group_id="probe", iteration=1, phase="train")
        store.write_calls([replace(call, span_id="ffffffffffffffff", rollout_id=rid, attributes={
            **call.attributes, "gen_ai.output.messages": json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": PROBE}]}])})])
        store.finish_rollout(rid, status="succeeded", output=PROBE, reward=0.0)
    page.goto(live["base"] + f"/#/run/main/rollout/{rid}")
    page.wait_for_selector(".span.llm")
    assert page.locator(".span.llm .cols > div").nth(1).locator("pre").text_content() == PROBE
    assert page.locator("#output").text_content() == PROBE
    assert page.evaluate("window.__xss") is None and page.locator("img").count() == 0

    # Filters: status and component, then a reward range, each answered by the server over the store.
    page.goto(live["base"] + "/#/run/main")
    page.wait_for_selector("tr.click")
    page.select_option("select[name=status]", "failed")
    page.wait_for_selector("text=no rollout matches")
    page.select_option("select[name=status]", "")
    page.wait_for_selector("tr.click")
    page.select_option("select[name=component]", "solver")
    page.fill("input[name=min_reward]", "1")
    page.dispatch_event("input[name=min_reward]", "change")
    with Store(live["dir"] / "store.sqlite", read_only=True) as store:
        wins = [r.rollout_id for r in store.rollouts() if r.reward is not None and r.reward >= 1]
    shown = f"1–{len(wins)} of {len(wins)}" if wins else "no rollout matches"
    page.wait_for_selector(f".pager >> text={shown}")
    assert sorted(page.locator("tr.click").evaluate_all("rows => rows.map(r => r.dataset.rollout)")) == sorted(wins)

    # Two runs side by side: a copy of the run beside it (a second real run would double the test's time).
    shutil.copytree(live["dir"], project / "runs/copy", ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    page.goto(live["base"] + "/#/")
    page.wait_for_selector("#compare")
    page.select_option("select[name=a]", "main")
    page.select_option("select[name=b]", "copy")
    page.screenshot(path=str(shots / "runs.png"))
    page.click("#compare")
    page.wait_for_selector(".side:nth-child(2) tbody tr")
    assert page.locator(".side h3").all_text_contents() == ["main", "copy"]
    assert page.locator("svg[aria-label='reward per iteration'] polyline").count() == 2
    page.screenshot(path=str(shots / "compare.png"), full_page=True)
    assert errors == []


def test_every_request_needs_the_key_and_nothing_writes(live, project):
    _finish(live, project)
    base, token = live["base"], live["token"]
    port = base.rsplit(":", 1)[1]
    for path in ("/", "/static/app.js", "/api/runs", "/api/summary?run=main"):
        assert httpx.get(base + path).status_code == 401
        assert httpx.get(base + path, cookies={f"lightning_dashboard_{port}": "wrong"}).status_code == 401
    first = httpx.get(f"{base}/?token={token}")
    assert first.status_code == 303 and first.headers["location"] == "/"
    assert "HttpOnly" in first.headers["set-cookie"] and "SameSite=strict" in first.headers["set-cookie"]
    with httpx.Client(base_url=base, cookies={f"lightning_dashboard_{port}": token}) as c:
        page = c.get("/")
        assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
        assert "'unsafe-inline'" not in page.headers["content-security-policy"]
        assert c.post("/api/runs").status_code == 405
        assert c.get("/api/summary", params={"run": "../.."}).status_code == 404
        assert c.get("/api/rollouts", params={"run": "main", "status": "bogus"}).status_code == 422
        assert c.get("/api/rollouts", params={"run": "main", "limit": 501}).status_code == 422
        # Pages: newest first, disjoint, together the whole store.
        total = c.get("/api/rollouts", params={"run": "main", "limit": 1}).json()["total"]
        ids = []
        for offset in range(0, total, 3):
            ids += [r["rollout_id"] for r in c.get("/api/rollouts", params={"run": "main", "limit": 3,
                                                                             "offset": offset}).json()["rows"]]
        with Store(live["dir"] / "store.sqlite", read_only=True) as store:
            assert ids == [r.rollout_id for r in store.rollouts(newest_first=True)] and len(ids) == total


def test_bad_run_dir_is_one_line_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout.strip().splitlines() == [
        f"error: --run-dir {tmp_path / 'nope'}: no such directory (a run directory or a folder of runs)"]
