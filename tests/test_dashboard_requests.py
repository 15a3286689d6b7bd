"""`lightning dashboard` over a run directory written here, asked with raw HTTP: what a request may hold (no
control character) and where a redirect may send the browser (this server only)."""

import os
import subprocess
import sys
from urllib.parse import urljoin

import httpx
import pytest

from lightning_sdk.store import Store


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    with Store(root / "main/store.sqlite") as store:
        store.start_rollout("r-1", task_id="t", group_id="g", iteration=1, phase="train")
        store.finish_rollout("r-1", status="succeeded", output="5", reward=1.0)
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
