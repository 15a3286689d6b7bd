"""Issue 52's feedback attacks on a real `lightning serve` (the built-in tiny model, 127.0.0.1), from whichever
checkout is on PYTHONPATH: one line per item (1, 7, 8; item 8 in three parts).

    PYTHONPATH=/work/before python scripts/serve_attacks/feedback.py    # before
    PYTHONPATH=$PWD python scripts/serve_attacks/feedback.py            # after

Everything goes through HTTP (the OpenAI client, POST /v1/feedback) and the store's SQLite file, which both
checkouts share; the retention part runs the pass serve runs every minute (retention.prune) on the served store.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))
import serving  # noqa: E402

LEARN = "[learn]\nevery_rewarded = 4\npoll_seconds = 1\n"
WAIT_S = 75  # how long item 1 waits for learning to go on after the attack


def client(s: serving.Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key=s.key, max_retries=0, timeout=60)


def reply(c: openai.OpenAI, text: str = "What is 2 + 2?") -> str:
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=2).id


def give(s: serving.Served, body: dict) -> int:
    return httpx.post(f"{s.url}/feedback", json=body, headers=s.headers, timeout=60).status_code


def store(s: serving.Served) -> sqlite3.Connection:
    return sqlite3.connect(s.directory / "serve.sqlite", timeout=30)


def item_1() -> None:
    """Two feedbacks of 1.7e308 on one reply, then honest rewards: does learning go on?"""
    with serving.serve(LEARN) as s:
        c = client(s)
        target = reply(c)
        codes = [give(s, {"response_id": target, "value": 1.7e308, "feedback_id": f"huge{i}"}) for i in range(2)]
        for i in range(16):  # honest traffic: four prompts, rewarded by response id
            give(s, {"response_id": reply(c, f"What is {i % 4} + 1?"), "value": float(i % 2)})
        deadline = time.monotonic() + WAIT_S
        versions = 0
        while time.monotonic() < deadline:
            db = store(s)
            try:
                versions = db.execute("SELECT COUNT(*) FROM learn_updates").fetchone()[0]
            except sqlite3.OperationalError:
                versions = 0
            finally:
                db.close()
            if versions:
                break
            time.sleep(1)
        quarantined = s.log_text().count("not a finite number")
    serving.emit(1, "two 1.7e308 feedbacks on one reply: their answers; then 16 honest rewards (every_rewarded=4): "
                    f"versions minted within {WAIT_S} s; log lines 'not a finite number'",
                 f"answers {'/'.join(map(str, codes))}; versions {versions}; lines {quarantined}")


def item_7(s: serving.Served) -> None:
    c = client(s)
    plain = c.responses.create(model="m", input="What is 3 + 3?", max_output_tokens=2).id
    streamed = list(c.responses.create(model="m", input="What is 3 + 3?", max_output_tokens=2, stream=True))
    streamed_id = streamed[-1].response.id
    codes = [give(s, {"response_id": rid, "value": 1.0}) for rid in (plain, streamed_id)]
    serving.emit(7, "feedback by the resp_... id a Responses app got (plain / streamed)", "/".join(map(str, codes)))


def item_8(s: serving.Served) -> None:
    c = client(s)
    theirs, mine = reply(c), reply(c)
    squat = give(s, {"response_id": mine, "value": -1.0, "feedback_id": f"response_id:{theirs}:reward"})
    app = give(s, {"response_id": theirs, "value": 1.0})
    theirs2 = reply(c)
    first = give(s, {"response_id": theirs2, "value": -1.0})
    app2 = give(s, {"response_id": theirs2, "value": 1.0})
    serving.emit(8, "squatting: another's default id spelled on one's own reply, then the app's reward; another's "
                    "reward under the default id first, then the app's",
                 f"squat {squat}, app {app}; first {first}, app {app2}")
    target = reply(c)
    taken = sum(give(s, {"response_id": target, "value": 1.0, "feedback_id": f"amp{i}"}) == 200 for i in range(50))
    serving.emit(8, "amplification: 50 feedbacks with distinct ids on one reply, how many were taken", taken)


def item_8_retention() -> None:
    from lightning_sdk.production.retention import prune  # the pass serve runs every minute, of this checkout

    with serving.serve("", "--max-calls", "5") as s:
        c = client(s)
        for i in range(30):
            give(s, {"response_id": reply(c, f"What is {i} + 1?"), "value": 1.0})
        prune(s.directory / "serve.sqlite", retention_s=30 * 86400, max_calls=5, reward_name=None)
        db = store(s)
        try:
            calls = db.execute("SELECT COUNT(*) FROM spans WHERE source='gateway'").fetchone()[0]
            rows = db.execute("SELECT COUNT(*) FROM feedback").fetchone()[0]
        finally:
            db.close()
    serving.emit(8, "retention (--max-calls 5): 30 rewarded calls, then a retention pass: calls / feedback rows "
                    "left", f"{calls} / {rows}")


def main() -> None:
    item_1()
    with serving.serve() as s:
        item_7(s)
        item_8(s)
    item_8_retention()


if __name__ == "__main__":
    main()
