"""What `lightning serve` keeps: calls past the retention window and the oldest beyond the cap are deleted, in one
SQLite transaction, except a call an unconsumed reward still needs (real SQLite store and feedback ledger)."""

import sqlite3
import time

from click.testing import CliRunner

from lightning_sdk.cli import main
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.production.retention import prune
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import GATEWAY, PROMPT_IDS, SpanRecord

DAY = 86400.0


def call(i: int, end: float) -> SpanRecord:
    ns = int(end * 1e9)
    return SpanRecord(span_id=f"{i:016x}", trace_id=f"{i:032x}", parent_id=None, rollout_id=f"r{i}", attempt=1,
                      component=None, name="chat", start_ns=ns - 1000, end_ns=ns, status="OK", status_message=None,
                      attributes={PROMPT_IDS: [1, 2]}, source=GATEWAY)


def left(path) -> list[int]:
    return [int(r[0], 16) for r in sqlite3.connect(path).execute("SELECT span_id FROM spans ORDER BY span_id")]


def test_calls_past_the_window_or_the_cap_are_deleted_but_those_an_unread_reward_needs(tmp_path):
    now = time.time()
    path = tmp_path / "serve.sqlite"
    with Store(path) as store:  # calls 0-2 ten days old, 3-5 an hour old
        store.write_calls([call(i, now - 10 * DAY + i) for i in range(3)] +
                          [call(i, now - 3600 + i) for i in range(3, 6)])
    ledger = FeedbackLedger(path, retention_s=DAY)
    for i in (0, 1):  # rewarded while they were young
        ledger.give({"call_id": f"{i:016x}", "value": 1.0}, now=now - 10 * DAY + 10)
    ledger.give({"call_id": f"{4:016x}", "value": 1.0}, now=now)
    ledger.close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO learn_consumed (feedback_id, version) VALUES (?, 1)", (f"call_id:{1:016x}:reward",))
    db.commit()
    p = prune(path, retention_s=DAY, max_calls=3, reward_name="reward", now=now)
    # age: 1 (its reward read) and 2 (none) go, 0 stays (its reward is unread); the cap of 3 keeps 0 and 4
    # (needed) and the newest of the rest (5): 3 goes
    assert (p.aged, p.over_cap, p.kept) == (2, 1, 1) and left(path) == [0, 4, 5]
    assert prune(path, retention_s=DAY, max_calls=3, reward_name="reward", now=now) == type(p)(0, 0, 1)
    db.execute("INSERT INTO learn_consumed (feedback_id, version) VALUES (?, 2)", (f"call_id:{0:016x}:reward",))
    db.commit()
    p = prune(path, retention_s=DAY, max_calls=1, reward_name="reward", now=now)
    assert (p.aged, p.over_cap, p.kept) == (1, 1, 0) and left(path) == [4]  # 4's reward still unread: over cap
    assert prune(path, retention_s=DAY, max_calls=1, reward_name=None, now=now).over_cap == 0  # 1 call <= cap
    assert prune(path, retention_s=1e-3, max_calls=None, reward_name=None, now=now).aged == 1  # no learner
    # each reward went with its call, but the newest row: SQLite numbers the next row from it
    assert left(path) == []
    assert db.execute("SELECT feedback_id FROM feedback").fetchall() == [(f"call_id:{4:016x}:reward",)]


def test_a_bad_max_calls_is_one_line_and_exit_2(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "l.toml"), "--max-calls", "0"])
    assert r.exit_code == 2 and "--max-calls" in r.output
