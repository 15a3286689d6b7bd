"""What a holder of the workers' key sends that the server prints or logs: a worker name with a newline or an
ANSI/OSC escape is refused (400 naming the field), a rollout id in a path is logged escaped, and results for
rollouts nobody holds are logged once per source a minute, not once each."""

from __future__ import annotations

import logging
from urllib.parse import quote

import httpx
import pytest

from .remote_harness import KEY, job
from .test_remote_protocol import api  # noqa: F401 - the fixture: a real gateway with the work routes

AUTH = {"Authorization": f"Bearer {KEY}"}
FORGED = ["ok\nFAKE LINE: iteration 9: reward 1.000 (forged)", "\x1b[2J\x1b[H", "name\x1b]0;pwned\x07", "a\rb",
          "bidi\u202eevil"]


@pytest.mark.parametrize("name", FORGED)
def test_a_worker_name_with_control_characters_is_refused(api, name):
    api.queue([job(0, {"question": "?"})])
    r = httpx.post(f"{api.url}/v1/work/claim", json={"worker": name}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "worker", r.text
    assert "control character" in r.json()["error"]["message"]
    assert api.dispatch.counts() == (1, 0)  # nothing claimed
    claim = httpx.post(f"{api.url}/v1/work/claim", json={"worker": "plain name"}, headers=AUTH, timeout=30).json()
    r = httpx.post(f"{api.url}/v1/work/r-0/result", json={"worker": name, "status": "succeeded", "reward": 1.0},
                   headers={**AUTH, "x-lightning-claim": claim["secret"]}, timeout=30)
    assert r.status_code == 400  # the holder's rollout fails with the line; the name is printed nowhere
    [result] = api.results(1)
    assert result.status == "failed" and "worker" in result.error


def test_results_for_rollouts_nobody_holds_are_logged_once_per_source_a_minute(api, caplog):
    n = 3000
    with caplog.at_level(logging.DEBUG), httpx.Client(base_url=api.url, headers=AUTH, timeout=30) as c:
        for i in range(n):
            rid = f"gone-{i}" if i % 2 else f"gone\n{i}: FAKE LINE\x1b[2J"
            r = c.post(f"/v1/work/{quote(rid, safe='')}/result",
                       json={"worker": "w", "status": "succeeded", "reward": 1.0})
            assert r.status_code == 409
    lines = [rec.getMessage() for rec in caplog.records if rec.name.startswith("lightning_sdk")]
    logged = sum(len(line) + 1 for line in lines)
    print(f"{n} results for rollouts nobody holds: {len(lines)} line(s), {logged} bytes logged")
    assert len(lines) == 1 and logged < 400, lines
    assert "\n" not in lines[0] and "\x1b" not in lines[0] and "further such results from it are counted" in lines[0]
