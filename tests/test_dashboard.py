"""`lightning dashboard` in a real browser (Playwright driving Debian's chromium) over a real, short `lightning run`.

The run is watched live: its first rollout waits for a gate file, so the page is loaded while the run is under
way, and the iterations and the eval after training appear without a reload. Agent text is hostile: a task's
question, a tool's error and (written into the store afterwards) a completion carry script probes, and the test
checks they are shown as text and never run. Screenshots go to $DASHBOARD_SCREENSHOTS, else to the test's tmp dir
(the pictures in docs/dashboard/ are scripts/dashboard_screenshots.py's, over a longer run).
"""

import hashlib
import json
from decimal import ROUND_HALF_UP, Decimal
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from lightning_sdk.metric_names import current, current_row
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
    return float(output.strip() == task["answer"]) + len(output) / 100  # outputs of other lengths: group signal
'''


def js_fixed(x: float, digits: int = 3) -> str:
    """`x.toFixed(digits)` as the page's JavaScript writes it: the double's exact value rounded half up (Python's
    format rounds half to even: 0.5625 gives 0.562 there, 0.563 on the page)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


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
    assert iter_rows.nth(2).locator("td").nth(2).text_content() == js_fixed(current_row(metrics[1])["rollout/reward_mean"])
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
    assert cells[7:9] == ["1", str(len(spans))]  # LLM calls, all spans

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
    assert f"credited reward {js_fixed(probe_rollout.reward + 0.5 - 1.0)}" in llm.text_content()
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
        assert c.get("/api/rollouts", params={"run": "main", "status": "bogus"}).status_code == 400
        assert c.get("/api/rollouts", params={"run": "main", "limit": 501}).status_code == 400
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


# ------------------------------------------------------------------------ issue 27: what each page explains

def _open(browser, live, where: str):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(live["url"] + where)
    return page, errors


def _until(page, expression: str, seconds: float = 20) -> None:
    """Wait until `expression` is true in the page. Polled from here: Playwright's own polling of a string predicate
    runs it through eval, which the dashboard's Content-Security-Policy forbids."""
    for _ in range(int(seconds * 20)):
        if page.evaluate(expression):
            return
        page.wait_for_timeout(50)
    raise AssertionError(f"still false after {seconds} s: {expression}")


def _iteration_rows(run_dir: Path) -> list[dict]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if r.get("phase") != "eval"]


def test_every_logged_scalar_has_its_chart_and_the_reward_its_std_band(live, project, browser, tmp_path):
    _finish(live, project)
    rows = _iteration_rows(live["dir"])
    numeric = {current(k) for r in rows for k, v in r.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    # the reward's mean and std are the reward chart (a line and its band); tokens per completion is derived
    wanted = (numeric - {"iteration", "rollout/reward_mean", "rollout/reward_std"}) | {"tokens_per_completion"}
    assert {"train/loss", "train/grad_norm", "train/entropy", "train/clip_frac", "train/zero_variance_frac",
            "train/logprob_gap", "time/collect_s", "time/update_s"} <= wanted and "train/kl" not in wanted  # beta 0
    page, errors = _open(browser, live, "#/run/main")
    page.wait_for_selector(".chart")
    # a chart for each key that moved, and one line for the keys every iteration logged alike
    charted = page.locator(".chart").evaluate_all("cs => cs.map(c => c.dataset.key)")
    same = page.locator(".constants .constant").evaluate_all("cs => cs.map(c => c.dataset.key)")
    assert sorted(charted + same) == sorted(wanted) and "train/loss" in charted
    band = page.locator("svg[aria-label='reward per iteration'] path.band")
    assert band.count() == 1 and band.get_attribute("d").count("L") == 2 * len(rows) - 1  # mean+std out, mean-std back
    # smoothing: the loss line is redrawn as a moving average, the raw values stay beside it, faded
    loss = page.locator(".chart[data-key='train/loss'] path.line")
    raw_d = loss.get_attribute("d")
    assert page.locator(".chart path.raw").count() == 0
    page.locator("input[name=smoothing]").fill("0.9")
    _until(page, "document.querySelectorAll('.chart path.raw').length > 0")
    losses = [current_row(r)["train/loss"] for r in rows]
    smoothed = page.locator(".chart[data-key='train/loss'] path.line").get_attribute("d")
    assert (smoothed != raw_d) == (len(set(losses)) > 1)
    assert errors == []


def test_config_is_shown_and_two_runs_differ_first(live, project, browser):
    _finish(live, project)
    config = json.loads((live["dir"] / "config.json").read_text())
    assert config["train"]["lr"] == 2e-3 and config["train"]["clip_eps"] is not None  # a default, written out
    # a second run that used lr 1e-3: a copy of this one, as `lightning run` would have recorded it
    other = project / "runs/try"
    shutil.copytree(live["dir"], other, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    config["train"]["lr"], config["run"]["name"], config["run"]["dir"] = 1e-3, "try", str(other)
    (other / "config.json").write_text(json.dumps(config))

    page, errors = _open(browser, live, "#/run/main")
    page.wait_for_selector("details.config")
    page.click("details.config summary")
    assert page.locator("details.config tr[data-key='train.lr'] td").all_text_contents() == ["train.lr", "0.002"]
    assert "config.json in the run" in page.locator("details.config summary").text_content()

    page.goto(live["base"] + "/#/compare/main/try")
    page.wait_for_selector(".config-diff tbody tr")
    rows = page.locator(".config-diff tbody tr")
    assert rows.nth(0).locator("td").all_text_contents() == ["train.lr", "0.002", "0.001"]
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.key)") == ["train.lr"]  # name and dir said apart
    assert page.locator(".diff-count").text_content() == "1 setting differs"
    # each run's eval lines in its own curve's colour, and named in the legend
    chart = page.locator("svg[aria-label='reward per iteration']")
    curves = chart.locator("polyline.line").evaluate_all("ps => ps.map(p => p.getAttribute('stroke'))")
    evals = chart.locator("line.eval-line").evaluate_all(
        "ls => ls.map(l => [l.dataset.run, l.dataset.when, l.getAttribute('stroke')])")
    assert len(set(curves)) == 2
    assert sorted(evals) == sorted([["main", "before", curves[0]], ["main", "after", curves[0]],
                                    ["try", "before", curves[1]], ["try", "after", curves[1]]])
    legend = chart.locator("text.legend").all_text_contents()  # eval.jsonl shares no task with train.jsonl
    assert sum(t.startswith("main held-out score before: ") and t.endswith(" (1 task)") for t in legend) == 1
    assert sum(t.startswith("try held-out score after: ") for t in legend) == 1
    assert errors == []


def test_rollout_list_previews_sorts_searches_and_keeps_its_state_in_the_url(live, project, browser):
    _finish(live, project)
    with Store(live["dir"] / "store.sqlite", read_only=True) as store:
        records = store.rollouts()
        tasks = {r.task_id: store.task(r.task_id) for r in records}
    page, errors = _open(browser, live, "#/run/main")
    page.wait_for_selector("tr.click")
    everyone = page.locator("tr.click").count()
    # previews: the task's question and the output, as text
    first = page.locator("tr.click").first
    rid = first.get_attribute("data-rollout")
    record = next(r for r in records if r.rollout_id == rid)
    cells = first.locator("td")
    assert cells.nth(1).text_content() == " ".join(tasks[record.task_id]["question"].split())[:160]
    assert cells.nth(2).text_content() == " ".join((record.output or "").split())[:160]
    probe = page.locator("tr.click td.preview", has_text="What is 2 + 3? <script>")  # the probe task, as text
    assert probe.count() > 0 and page.evaluate("window.__xss") is None and page.locator("img").count() == 0

    def rewards():
        return [float(t) if t else None for t in page.locator("tr.click td:nth-child(7)").all_text_contents()]

    page.click("th[data-sort=reward]")
    _until(page, "location.hash.includes('sort=reward')")
    _until(page, "document.querySelector('th[data-sort=reward]').textContent.endsWith('▼')")
    shown = [r for r in rewards() if r is not None]
    assert shown == sorted(shown, reverse=True) and len(set(shown)) > 1
    page.click("th[data-sort=reward]")
    _until(page, "location.hash.includes('desc=0')")
    _until(page, "document.querySelector('th[data-sort=reward]').textContent.endsWith('▲')")
    shown = [r for r in rewards() if r is not None]
    assert shown == sorted(shown)

    # search: server-side, over the task's text and the output; its words go into the address
    wanted = {r.rollout_id for r in records if "4 + 4" in (r.output or "") or "4 + 4" in tasks[r.task_id]["question"]}
    assert 0 < len(wanted) < everyone
    page.fill("input[name=q]", "4 + 4")
    _until(page, "location.hash.includes('q=')")
    _until(page, f"document.querySelectorAll('tr.click').length === {len(wanted)}")
    assert set(page.locator("tr.click").evaluate_all("rs => rs.map(r => r.dataset.rollout)")) == wanted
    assert "4 + 4" in page.evaluate("new URLSearchParams(location.hash.split('?')[1]).get('q')")
    page.fill("input[name=q]", "%")  # LIKE's wildcard is looked for as itself: no output or task has it
    page.wait_for_selector("text=no rollout matches")
    # Back: the list as it was before each change
    page.go_back()
    _until(page, f"document.querySelectorAll('tr.click').length === {len(wanted)}")
    assert page.input_value("input[name=q]") == "4 + 4"
    page.go_back()
    _until(page, f"document.querySelectorAll('tr.click').length === {everyone}")
    assert page.input_value("input[name=q]") == "" and "desc=0" in page.url
    assert errors == []


def test_a_rollout_page_explains_its_advantage_with_the_trainers_numbers(live, project, browser):
    from lightning_sdk import credit
    from lightning_sdk.train.grpo import group_advantages
    from lightning_sdk.transitions import to_transitions

    _finish(live, project)
    # A group whose rewards differ (outputs of other lengths), as the trainer saw it: its succeeded rollouts'
    # transitions. The test's own probe rollout (written into the store above) is in no iteration's batch.
    with Store(live["dir"] / "store.sqlite", read_only=True) as store:
        train = [r for r in store.rollouts(phase="train") if r.status == "succeeded" and r.group_id != "probe"]
        groups: dict[str, list] = {}
        for r in train:
            groups.setdefault(r.group_id, []).append(r)
        gid, members = next((g, m) for g, m in groups.items() if len({r.reward for r in m}) > 1)
        ts = [t for r in members for t in to_transitions(r, store.spans(r.rollout_id), credit=credit.last_call,
                                                          error_reward=-1.0)]
        task = store.task(members[0].task_id)
        spans = {r.rollout_id: store.spans(r.rollout_id) for r in members}
    adv = group_advantages([t.outcome for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts], "group",
                           credit=[t.credit for t in ts], shaping=[t.shaping for t in ts],
                           scored={gid: {r.rollout_id: r.reward for r in members}}).tolist()
    mine = ts[0]
    page, errors = _open(browser, live, f"#/run/main/rollout/{mine.rollout_id}")
    page.wait_for_selector(f"#span-{mine.span_id} .advantage [data-field=value]")
    box = page.locator(f"#span-{mine.span_id} .advantage")
    value = lambda k: float(box.locator(f"[data-field={k}]").get_attribute("data-value"))  # noqa: E731
    assert value("value") == pytest.approx(adv[0], abs=1e-6)
    assert value("outcome") == mine.outcome and value("credit") == mine.credit and value("shaping") == mine.shaping
    rewards = [r.reward for r in members]
    assert value("group_mean") == pytest.approx(sum(rewards) / len(rewards))
    sentence = box.locator(".adv-sentence").text_content()
    assert "last_call" in sentence and f"{adv[0]:.3g}" in sentence
    credit_line = page.locator("#credit").text_content()
    assert "last_call" in credit_line and "config.json in the run" in credit_line and "(" not in credit_line
    # the group side by side, its expected answer, the completion's log-probs token by token
    cards = page.locator(".group .member")
    assert sorted(cards.evaluate_all("cs => cs.map(c => c.dataset.rollout)")) == sorted(r.rollout_id for r in members)
    assert page.locator(".group .member.self").get_attribute("data-rollout") == mine.rollout_id
    for r in members:
        card = page.locator(f".group .member[data-rollout='{r.rollout_id}']")
        assert card.locator("pre.out").text_content() == (r.output or "")
        assert card.locator("[data-field=reward]").text_content() == js_fixed(r.reward)
    assert page.locator("#expected").text_content() == task["answer"]
    call = next(s for s in spans[mine.rollout_id] if s.span_id == mine.span_id)
    cells = page.locator(f"#span-{mine.span_id} .logprobs .tok")
    assert cells.count() == len(call.attributes["lightning.llm.completion_token_ids"]) == len(mine.completion_ids)
    texts = call.attributes["lightning.llm.completion_tokens"]
    lps = call.attributes["lightning.llm.completion_logprobs"]
    assert cells.first.get_attribute("title").startswith(f"token {json.dumps(texts[0])}")
    assert float(cells.first.get_attribute("data-logprob")) == pytest.approx(lps[0])
    assert page.evaluate("window.__xss") is None and errors == []
