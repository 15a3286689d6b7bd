"""Issue 52's canary attacks on a real `lightning serve` (the checkout on PYTHONPATH), one figure line per item:

- item 2: with canary_share = 0.5 and poll_seconds = 1, an episode reward of 1.7e308 on two of the canary's episodes
  (POST /v1/feedback; where the ledger refuses it, the value is set in the store as a store made before that check
  holds it), then honest rewards on both sides: is the canary decided within 30 s, how many tracebacks and log bytes
  in that window, and what `lightning dashboard`'s /api/summary answers for that serve directory.
- item 4: kill -9 of the serving process right after the statement that writes the gate's pass (a sitecustomize
  hook on PYTHONPATH sends SIGKILL to itself there), then a restart on the same directory: which adapter serves 16
  new episodes, and whether the candidate has a canary. Again with the kill at the first COMMIT after the pass.

Run: `PYTHONPATH=<checkout> python scripts/serve_attacks/canary.py` (about 3 minutes).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

HUGE = 1.7e308
LEARN = ("[learn]\nevery_rewarded = 4\ncanary_share = 0.5\ncanary_min_rewards = 3\ngate_margin = 1000000\n"
         "poll_seconds = 1\n")
HOOK = '''
import os, signal, sqlite3
KILL_AT = os.environ.get("CANARY_FIGURE_KILL_AT")
if KILL_AT:
    armed = []
    class KilledAt(sqlite3.Connection):
        def execute(self, sql, *args):
            cursor = super().execute(sql, *args)
            said = " ".join(sql.split()).upper()
            if said.startswith("INSERT INTO PROMOTIONS"):
                armed.append(self)
            # a COMMIT: that of the pass's own connection; another statement: the first after the pass
            if (self in armed if KILL_AT == "COMMIT" else armed) and said.startswith(KILL_AT):
                os.kill(os.getpid(), signal.SIGKILL)
            return cursor
    connect = sqlite3.connect
    sqlite3.connect = lambda *a, **k: connect(*a, factory=KilledAt, **k)
'''


def rows(directory: Path, sql: str) -> list[tuple]:
    try:
        db = sqlite3.connect(f"{(directory / 'serve.sqlite').resolve().as_uri()}?mode=ro", uri=True, timeout=30)
    except sqlite3.OperationalError:
        return []
    try:
        return db.execute(sql).fetchall()
    except sqlite3.OperationalError:  # a table not made yet
        return []
    finally:
        db.close()


def chat(client: httpx.Client, url: str, trace: str) -> str:
    """One call of episode `trace`; the adapter that served it."""
    r = client.post(f"{url}/chat/completions", json={"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "What is 1 + 1?"}]}, headers={"traceparent": f"00-{trace}-{'cd' * 8}-01"})
    r.raise_for_status()
    return r.json()["model"]


def feedback(client: httpx.Client, url: str, trace: str, value: float, feedback_id: str) -> int:
    body = json.dumps({"episode_id": trace, "value": value, "feedback_id": feedback_id})  # 1.7e308 as JSON allows
    return client.post(f"{url}/feedback", content=body, headers={"Content-Type": "application/json"}).status_code


def traces(salt: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest()[:32] for i in range(n)]


def wait(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.25)
    return condition()


def first_pass(s: serving.Served, client: httpx.Client) -> None:
    """4 rewarded episodes: an update, past the gate (gate_margin 10^6)."""
    for i, t in enumerate(traces("warm", 4)):
        chat(client, s.url, t)
        feedback(client, s.url, t, float(i % 2), f"warm{i}")


def dashboard_summary(root: Path, adapter: str) -> str:
    # cwd: not this checkout (`-m` puts the working directory first on sys.path, before PYTHONPATH)
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(root), "--port",
                             "0"], env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=root)
    try:
        line = proc.stdout.readline()
        if " at " not in line:
            return f"dashboard did not start: {line.strip()[:200]}"
        url = line.split(" at ", 1)[1].split()[0]
        base, token = url.split("/?", 1)[0], url.split("token=", 1)[1]
        with httpx.Client(base_url=base, cookies={f"lightning_dashboard_{base.rsplit(':', 1)[1]}": token},
                          timeout=60) as c:
            got = c.get("/api/summary", params={"run": "serve"})
            if got.status_code != 200:
                return str(got.status_code)
            live = {r["adapter"]: r["live"] for r in (got.json().get("serve") or {}).get("versions", [])}
            shown = live.get(adapter)
            return f"200 ({adapter} live: " + (f"{shown['episodes']} episodes, mean {shown['mean']:.3g})" if shown
                                                   else "none)")
    finally:
        proc.terminate()
        proc.wait(30)


def item2() -> None:
    with serving.serve(LEARN) as s, httpx.Client(headers=s.headers, timeout=60) as client:
        first_pass(s, client)
        if not wait(lambda: rows(s.directory, "SELECT candidate FROM canaries"), 120):
            serving.emit(2, "canary (share 0.5) after a 1.7e308 episode reward", "no canary started in 120 s")
            return
        candidate = rows(s.directory, "SELECT candidate FROM canaries")[0][0]
        served = {t: chat(client, s.url, t) for t in traces("ep", 16)}
        on_canary = [t for t, m in served.items() if m == candidate]
        on_serving = [t for t, m in served.items() if m != candidate]
        refused = [code for k, t in enumerate(on_canary[:2]) if (code := feedback(client, s.url, t, HUGE, f"h{k}"))
                   != 200]
        if refused:  # the ledger bounds feedback: the value as a store made before the bound may hold it
            for k, t in enumerate(on_canary[:2]):
                feedback(client, s.url, t, 0.0, f"h{k}")
            db = sqlite3.connect(s.directory / "serve.sqlite", timeout=30)
            with db:
                db.executemany("UPDATE feedback SET value=? WHERE feedback_id=?", [(HUGE, f"h{k}") for k in range(2)])
            db.close()
        size, t0 = s.log.stat().st_size, time.monotonic()
        for t in on_canary[2:5]:
            feedback(client, s.url, t, 1.0, f"c{t}")
        for t in on_serving[:3]:
            feedback(client, s.url, t, 0.0, f"s{t}")
        decided = wait(lambda: rows(s.directory, "SELECT decided_at FROM canaries WHERE decided_at IS NOT NULL"), 30)
        seconds = time.monotonic() - t0
        text = s.log.read_bytes()[size:].decode(errors="replace")
        outcome = rows(s.directory, "SELECT promoted FROM canaries")
        status = dashboard_summary(s.directory.parent, candidate)
        said = (f"{'decided (' + ('promoted' if outcome[0][0] else 'rolled back') + ')' if decided else 'undecided'} "
                f"at {seconds:.0f} s; {text.count('Traceback (most recent call last)')} tracebacks, "
                f"{len(text.encode())} log bytes; /api/summary {status}")
        how = f" (the feedback refused {refused[0]} by the ledger; set in the store)" if refused else ""
        serving.emit(2, "canary (share 0.5, poll 1 s) after 1.7e308 on 2 canary episodes, then 3+3 honest rewards",
                     said + how)


def restart(s: serving.Served) -> tuple[subprocess.Popen, str]:
    """The CLI again on the same project and serve directory, with no kill hook; its process and app URL."""
    env = {**os.environ, "COLUMNS": "400", "LIGHTNING_SERVE_KEY": s.key}
    env.pop("CANARY_FIGURE_KILL_AT", None)
    log = s.directory.parent / "restart.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "serve", "-c",
                                 str(s.directory.parent / "lightning.toml"), "--dir", str(s.directory)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=s.directory.parent)
    found = wait(lambda: "serving " in log.read_text(errors="replace") or proc.poll() is not None, 120)
    line = next((x for x in log.read_text(errors="replace").splitlines() if x.startswith("serving ")), None)
    if not found or line is None:
        proc.kill()
        proc.wait()
        raise RuntimeError("the restart did not serve: " + log.read_text(errors="replace")[-2000:])
    return proc, line.split(" at ", 1)[1].split()[0]


def item4_at(kill_at: str) -> str:
    os.environ["CANARY_FIGURE_KILL_AT"] = kill_at
    try:
        with serving.serve(LEARN) as s, httpx.Client(headers=s.headers, timeout=60) as client:
            os.environ.pop("CANARY_FIGURE_KILL_AT")
            first_pass(s, client)
            # killed by the hook; or, where no such statement follows the pass, by this script once the canary's
            # row is there (the same point: after both writes)
            wait(lambda: s.proc.poll() is not None or rows(s.directory, "SELECT 1 FROM canaries"), 120)
            if s.proc.poll() is None and rows(s.directory, "SELECT 1 FROM canaries") and not wait(
                    lambda: s.proc.poll() is not None, 3):
                s.proc.kill()
            try:
                s.proc.wait(10)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
                return "no gate pass in 120 s"
            if s.proc.returncode != -9:
                return f"exited {s.proc.returncode}"
            proc, url = restart(s)
            try:
                served = [chat(client, url, t) for t in traces("after", 16)]
                passed = rows(s.directory, "SELECT candidate FROM promotions WHERE promoted=1")
                trials = rows(s.directory, "SELECT candidate FROM canaries WHERE decided_at IS NULL")
                candidate = passed[0][0] if passed else "app-serve-v1"
                return (f"{served.count(candidate)} of 16 episodes on {candidate}, "
                        f"{'its canary resumed' if trials else 'no canary'}, "
                        f"gate pass {'stored' if passed else 'not stored'}")
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        os.environ.pop("CANARY_FIGURE_KILL_AT", None)


def item4() -> None:
    with tempfile.TemporaryDirectory() as hook:
        (Path(hook) / "sitecustomize.py").write_text(HOOK)
        path = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = os.pathsep.join([hook, path] if path else [hook])
        try:
            at_pass = item4_at("INSERT INTO PROMOTIONS")
            at_commit = item4_at("COMMIT")
        finally:
            os.environ["PYTHONPATH"] = path
    serving.emit(4, "restart after kill -9 (a) right after the gate's pass is written, (b) after the first COMMIT "
                    "from it (16 new episodes)", f"(a) {at_pass}; (b) {at_commit}")


if __name__ == "__main__":
    item2()
    item4()
