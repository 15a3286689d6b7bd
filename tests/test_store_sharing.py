"""A call's prompt ids and messages are kept once across the calls that repeat them (store.py, `chunks`), and read
back exactly as they were sent: through the real gateway and built-in server on 127.0.0.1 over a 20-turn rollout
with a rewritten history and two components interleaved; written straight to the store for the odd shapes; a store
made before chunks (whole ids) still reads; deleting spans (as `lightning serve`'s retention does) frees only the
chunks no span holds; a writer killed with -9 leaves no span naming a chunk that is not there."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import openai

import lightning_sdk as ls
from lightning_sdk.production.retention import prune
from lightning_sdk.store import CHUNK_IDS, Store
from lightning_sdk.tracing.records import COMPLETION_IDS, GATEWAY, PROMPT_IDS, SpanRecord

from .conftest import in_rollout, recorded_calls


def chunk_ids(path: Path) -> int:
    """How many token ids the store's chunks of prompt ids hold."""
    db = sqlite3.connect(path)
    try:
        return sum(len(json.loads(f"[{b}]")) for (b,) in db.execute("SELECT body FROM chunks WHERE body NOT LIKE '{%'"))
    finally:
        db.close()


def test_a_20_turn_rollout_reads_back_exactly_what_was_sent(gw, store):
    seen: list[SpanRecord] = []
    gw.capture.exported = lambda records, _scope: seen.extend(records)  # the records as the gateway made them
    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    sent: list[list[int]] = []  # each call's prompt ids as the server tokenized them

    def ask(messages):
        out = client.chat.completions.create(model="policy", messages=messages, max_tokens=4,
                                             extra_body={"return_token_ids": True})
        sent.append(out.model_extra["prompt_token_ids"])
        return out.choices[0].message.content or ""

    try:
        with in_rollout(gw, "r-long"):
            talk = {"solver": [{"role": "system", "content": "You solve sums. " * 20},
                               {"role": "user", "content": "What is 2 + 3?"}],
                    "checker": [{"role": "system", "content": "You check sums. " * 20},
                                {"role": "user", "content": "Is 5 right?"}]}
            for turn in range(20):
                # two components interleaved in one rollout, each extending its own conversation
                name = "solver" if turn % 3 else "checker"
                with ls.component(name):
                    reply = ask(talk[name])
                talk[name] = talk[name] + [{"role": "assistant", "content": reply},
                                           {"role": "user", "content": f"observation {turn}: {turn * 7}"}]
            with ls.component("solver"):  # a rewritten history: the middle of the conversation dropped
                ask(talk["solver"][:2] + talk["solver"][-4:])
                ask([{"role": "system", "content": "Another prompt altogether."}] + talk["solver"][1:])
        calls = recorded_calls(gw, store, "r-long")
    finally:
        gw.capture.exported = None
    assert len(calls) == len(sent) == 22
    made = {r.span_id: r for r in seen}
    for call, ids in zip(calls, sent):
        assert call.attributes[PROMPT_IDS] == ids  # every id, in order, as the server saw it
        assert call == made[call.span_id]  # the whole record (messages text included) as the gateway made it
    whole = sum(len(ids) for ids in sent)
    # the repeated prompts are kept once: what is stored is the new ids and a partial chunk at each call's end
    assert chunk_ids(store.path) < whole / 2


def call_record(span_id: str, rollout: str, prompt: object, messages: object, start: int, **extra) -> SpanRecord:
    attributes = {"gen_ai.operation.name": "chat", PROMPT_IDS: prompt, "gen_ai.input.messages": messages,
                  COMPLETION_IDS: [7, 8, 9], **extra}
    return SpanRecord(span_id=span_id, trace_id="1" * 32, parent_id=None, rollout_id=rollout, attempt=1,
                      component=None, name="chat policy", start_ns=start, end_ns=start + 1, status="OK",
                      status_message=None, attributes=attributes, source=GATEWAY)


def conversation(turns: int, *, seed: int = 0, system: int = 900) -> list[tuple[list[int], str]]:
    """(prompt ids, messages text) of each call of a growing conversation, as an agent re-sends it."""
    ids = [(seed * 7919 + i * 31) % 50000 for i in range(system)]
    messages = [{"role": "system", "parts": [{"type": "text", "content": f"task {seed} " * 50}]}]
    out = []
    for t in range(turns):
        out.append((list(ids), json.dumps(messages)))
        ids += [(t * 131 + i) % 50000 for i in range(97 + t * 13)]  # completion and observation: uneven sizes
        messages = messages + [{"role": "assistant", "parts": [{"type": "text", "content": f"reply {t} é"}]},
                               {"role": "tool", "parts": [{"type": "tool_call_response", "id": f"c{t}",
                                                           "response": {"n": t, "x": [1.5, None]}}]}]
    return out


def test_odd_shapes_read_back_exactly(tmp_path):
    records, start = [], 0
    for seed in (0, 1):  # two rollouts of the same system prompt's length, different content
        for k, (ids, text) in enumerate(conversation(20, seed=seed)):
            start += 10
            records.append(call_record(f"{seed:02d}{k:014d}", f"r{seed}", ids, text, start))
    start += 10
    odd = [  # rewritten and shortened prompts, exact multiples of a chunk, values a hostile backend might send
        call_record("a" * 16, "r0", records[5].attributes[PROMPT_IDS][:CHUNK_IDS * 2], "[]", start + 1),
        call_record("b" * 16, "r0", [3] + records[19].attributes[PROMPT_IDS][1:], '[{"a": 1},{"b": 2}]', start + 2),
        call_record("c" * 16, "r0", [], "not json", start + 3),
        call_record("d" * 16, "r0", ["x", 1.5, None, [1, 2], {"k": "v, w"}, 2**70, -1], '[1, "a, b", [2, 3]]',
                    start + 4),
        call_record("e" * 16, "r0", "12345", 17, start + 5, **{"gen_ai.tool.definitions": json.dumps([{"t": 1}] * 3)}),
        call_record("f" * 16, "r0", list(range(CHUNK_IDS)), json.dumps([{"deep": [[[[]]]]}]), start + 6),
    ]
    with Store(tmp_path / "s.sqlite") as store:
        store.write_calls(records[:30])
        store.write_calls(records[30:] + odd)
        store.write_calls(records[3:9])  # the same records again (a retried batch): no conflict
        assert store.span_conflicts == 0
        back = store.spans("r0") + store.spans("r1")
    with Store(tmp_path / "s.sqlite", read_only=True) as reader:
        again = reader.spans("r0") + reader.spans("r1")
    want = sorted(records + odd, key=lambda r: (r.rollout_id, r.start_ns))
    assert back == want and again == want
    assert [list(r.attributes) for r in back] == [list(r.attributes) for r in want]  # each attribute in its place


def test_a_store_made_before_chunks_still_reads_and_takes_shared_calls(tmp_path):
    path = tmp_path / "old.sqlite"
    old = call_record("0" * 16, "r", list(range(1000)), json.dumps([{"role": "user", "parts": []}]), 1)
    db = sqlite3.connect(path)  # the spans table as stores were made before chunks, one call kept whole
    db.executescript("""
        CREATE TABLE spans (span_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL, parent_id TEXT, rollout_id TEXT NOT
        NULL, attempt INTEGER NOT NULL, component TEXT, name TEXT NOT NULL, start_ns INTEGER NOT NULL, end_ns INTEGER
        NOT NULL, status TEXT NOT NULL, status_message TEXT, attributes TEXT NOT NULL, events TEXT NOT NULL,
        source TEXT NOT NULL DEFAULT 'agent');""")
    db.execute("INSERT INTO spans VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
               (old.span_id, old.trace_id, None, "r", 1, None, old.name, 1, 2, "OK", None,
                json.dumps(old.attributes), "[]", GATEWAY))
    db.commit()
    db.close()
    with Store(path, read_only=True) as reader:  # as the dashboard opens it: nothing migrated
        assert reader.spans("r") == [old]
    new = call_record("1" * 16, "r", list(range(1000)) + [5, 6], json.dumps([{"role": "user", "parts": []}] * 2), 3)
    with Store(path) as store:  # a writer migrates it on open
        store.write_calls([new])
        assert store.spans("r") == [old, new]


def test_deleting_spans_frees_only_the_chunks_no_span_holds(tmp_path):
    path = tmp_path / "s.sqlite"
    calls = [call_record(f"{k:016x}", "r", ids, text, 10 * (k + 1))
             for k, (ids, text) in enumerate(conversation(12))]
    other = [call_record(f"{99:014x}{k:02x}", "q", ids, text, 1000 + k)
             for k, (ids, text) in enumerate(conversation(3))]
    with Store(path) as store:
        store.write_calls(calls + other)
    # retention deletes the oldest calls past its cap, the first calls of "r" among them: the later ones still read
    assert prune(path, retention_s=1, max_calls=9, reward_name=None, now=0).over_cap == 6
    with Store(path) as store:
        assert store.spans("r") == calls[6:] and store.spans("q") == other
        assert store.spans("r")[0].attributes[PROMPT_IDS] == calls[6].attributes[PROMPT_IDS]
    db = sqlite3.connect(path)
    held = db.execute("SELECT COUNT(*) FROM chunks WHERE refs <= 0").fetchone()[0]
    db.execute("DELETE FROM spans")
    db.commit()
    left = db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
    db.close()
    assert held == 0 and left == 0


WRITER = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from lightning_sdk.store import Store
    from tests.test_store_sharing import call_record, conversation
    store = Store(sys.argv[1])
    k = 0
    while True:
        for t, (ids, text) in enumerate(conversation(20, seed=k % 5)):
            store.write_calls([call_record(f"{k:08x}{t:08x}", f"r{k}", ids, text, t + 1)])
            print(k, t, flush=True)
        k += 1
""")


def test_a_writer_killed_mid_rollout_leaves_every_stored_call_whole(tmp_path):
    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "s.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(root), str(root)], stdout=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # into its third rollout, mid-way
            k, t = map(int, proc.stdout.readline().split())
            if k == 2 and t == 7:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    with Store(path) as store:
        for k in range(3):
            want = [call_record(f"{k:08x}{t:08x}", f"r{k}", ids, text, t + 1)
                    for t, (ids, text) in enumerate(conversation(20, seed=k % 5))]
            got = store.spans(f"r{k}")
            assert got == want[:len(got)] and len(got) >= (8 if k == 2 else 20)


def test_the_dashboard_s_rollout_page_shows_each_call_as_sent(tmp_path):
    from lightning_sdk.dashboard.runs import RunReader
    from lightning_sdk.tracing.records import messages

    calls = [call_record(f"{k:016x}", "r", ids, text, 10 * (k + 1)) for k, (ids, text) in enumerate(conversation(8))]
    with Store(tmp_path / "main" / "store.sqlite") as store:
        store.start_rollout("r", task_id="t", group_id="g", iteration=1, phase="train")
        store.write_calls(calls)
    page = RunReader(tmp_path).rollout("main", "r")
    shown = [s for s in page["spans"] if s["kind"] == "llm"]
    assert [s["input"] for s in shown] == [messages(c.attributes, "input") for c in calls]
    assert [s["prompt_tokens"] for s in shown] == [len(c.attributes[PROMPT_IDS]) for c in calls]


def test_a_call_that_repeats_the_last_one_only_in_value_is_stored_as_it_is(tmp_path):
    """The chunks of the conversation's last call are re-used where a call repeats it: never for what is equal in
    Python but not in JSON (1 and True, 1 and 1.0), nor for a list the caller changed after writing it."""
    ids = [1, 0] + list(range(1000, 998 + 3 * CHUNK_IDS))  # 1 == True == 1.0 in Python
    base = json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    shapes = [
        (list(ids), base),
        ([True] + ids[1:] + [7], base[:-1] + ', {"role": "tool"}]'),  # True == 1 in Python; "true" != "1" in JSON
        (ids + [7], base[:-1] + ', {"role": "tool"}]'),  # and back
        ([float(ids[0])] + ids[1:] + [7], base[:-1] + ', {"role": "tool"}]'),  # the same messages again
        (ids[:CHUNK_IDS] + [1.0] + ids[CHUNK_IDS + 1:], base[:-1] + ", oops]"),  # an extension that is not JSON
        (list(ids), base[:-1] + ',  {"spaced": 1}]'),  # an extension not written as json.dumps writes one
        (list(ids), base),
    ]
    records, changing = [], list(ids)
    with Store(tmp_path / "s.sqlite") as store:
        for k, (prompt, text) in enumerate(shapes):
            records.append(call_record(f"{k:016x}", "r", prompt, text, k + 1))
            store.write_calls([records[-1]])
        # the caller's list, changed in place after each write: each record keeps what it held when written
        for k in range(3):
            changing.extend([5] * 100)
            record = call_record(f"{100 + k:016x}", "r", changing, base, 100 + k)
            store.write_calls([record])
            records.append(call_record(record.span_id, "r", list(changing), base, 100 + k))
        assert store.spans("r") == records
        assert store.spans("r")[1].attributes[PROMPT_IDS][0] is True
        assert store.spans("r")[2].attributes[PROMPT_IDS][0] is not True
        assert type(store.spans("r")[3].attributes[PROMPT_IDS][0]) is float
