"""`lightning serve` with [learn]: the background trainer reads rewarded calls from the served log and makes an
update (stale calls left out and counted), a restart repeats no update and loses none, and the gate scores each
candidate with the eval machinery against the serving adapter and promotes (hot-loads) only a better one. Real
parts throughout: the tiny model's CPU server and the gateway on 127.0.0.1, SQLite, GRPO optimizer steps."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import openai
import pytest

import lightning_sdk as ls

from lightning_sdk import config
from lightning_sdk.evals import draw_seed
from lightning_sdk.production import deployment, gate

ROOT = Path(__file__).resolve().parents[1]

AGENT = '''
import lightning_sdk as ls
from openai import OpenAI

@ls.rollout
def solve(task, llm):
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    out = client.chat.completions.create(model=llm.model, max_tokens=2,
                                         messages=[{"role": "user", "content": task["question"]}])
    return out.model  # the adapter that served it, as the gateway answers

@ls.reward
def score(task, output):
    # Deterministic: the gate's decision is what is tested, not whether a tiny model learned arithmetic.
    return 1.0 if output.endswith(task["good"]) else 0.0
'''


def project(d: Path, *, every: int = 4, behind: int = 1) -> config.Config:
    (d / "agent.py").write_text(AGENT)
    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1), "good": "-iter1"} for a in range(3)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "lightning.toml").write_text(
        '[run]\nname = "app"\n[agent]\nmodule = "agent.py"\n[data]\ntrain = "train.jsonl"\neval = "eval.jsonl"\n'
        '[model]\nname = "builtin:tiny-arith"\ndtype = "float32"\n[serve]\nmax_batch_size = 4\n'
        '[train]\nlora_r = 4\nlr = 0.01\nbeta = 0.04\n'
        f'[learn]\nevery_rewarded = {every}\nmax_versions_behind = {behind}\npoll_seconds = 3600\n')
    return config.load(d / "lightning.toml")


def traffic(dep, n: int, prompt: str = "What is 2 + 2?") -> list[str]:
    """n calls of n episodes (one each), all with the same prompt, and a reward for each: 1 for the even ones."""
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key=dep.api_key, max_retries=0)
    ids = []
    for _ in range(n):
        trace = uuid.uuid4().hex  # one new episode per call
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=4, temperature=1.0,
                                       extra_headers={"traceparent": f"00-{trace}-{'cd' * 8}-01"})
        ids.append(trace)
    return ids


def reward_all(dep, traces: list[str], salt: str = "") -> None:
    for i, t in enumerate(traces):
        dep.ledger.give({"episode_id": t, "value": float(i % 2), "feedback_id": f"{salt}{t}"})


def wait_for(condition, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the background trainer did not get there in time"
        time.sleep(0.05)


def lora_b(checkpoint: Path) -> float:
    from safetensors.torch import load_file
    w = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    return float(sum(v.abs().sum() for k, v in w.items() if "lora_B" in k))


def start_serve(project: Path, directory: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", "LIGHTNING_SERVE_KEY": "app-key"}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "serve", "-c", str(project), "--dir",
                             str(directory), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=project.parent)
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving "):
            return proc, line.split(" at ", 1)[1].split()[0]
    proc.kill()
    raise AssertionError("lightning serve did not start: " + "".join(lines))


def served_models(dep) -> list[str]:
    """The model and adapters loaded in the serving backend, as it lists them."""
    import httpx

    r = httpx.get(f"{dep.server.base_url}/models", headers={"Authorization": f"Bearer {dep.server.api_key}"})
    return [m["id"] for m in r.raise_for_status().json()["data"]]


def no_gate(candidate, serving, draw):  # a gate that never promotes: the test looks at the updates alone
    return [-1.0, -1.0], [0.0, 0.0]


def every_one_better(candidate, serving, draw):  # each version scores above the one before: the gate passes each
    return [float(candidate[1])] * 2, [float(serving[1])] * 2


def test_learn_is_validated_at_the_edge(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q"}\n')
    for body, expected in (('[learn]\nevery_rewarded = 0\n', r"learn.every_rewarded"),
                           ('[learn]\nunknown = 1\n', r"learn.unknown"),
                           ('[learn]\n', r"data.eval"),
                           ('eval = "train.jsonl"\n[learn]\ncanary_share = 1.0\n', r"learn.canary_share"),
                           ('eval = "train.jsonl"\n[learn]\ncanary_share = 0\n', r"learn.canary_share"),
                           ('eval = "train.jsonl"\n[learn]\ncanary_min_rewards = 1\n',
                            r"learn.canary_min_rewards: expected 2 to 10\^6 rewarded episodes"),
                           ('[serve]\nstore_text = "maybe"\n', r"serve.store_text")):
        (tmp_path / "l.toml").write_text('[data]\ntrain = "train.jsonl"\n' + body)
        with pytest.raises(config.ConfigError, match=expected):
            config.load(tmp_path / "l.toml")


def test_the_trainer_consumes_rewarded_calls_a_restart_repeats_no_update_and_stale_calls_are_counted(tmp_path):
    cfg = project(tmp_path)
    d = tmp_path / "serve"
    dep = deployment.start(cfg, d, host="127.0.0.1", port=0, api_key=None, retention_s=3600,
                           scorer=every_one_better)
    try:
        learner = dep.schedule.learner
        first = traffic(dep, 4)
        late = traffic(dep, 4, prompt="What is 3 + 3?")  # served by the base model, rewarded after two updates
        dep.gateway.capture.flush()
        reward_all(dep, first[:3])
        assert not learner.due()  # 3 of every_rewarded = 4
        reward_all(dep, first[3:], salt="")
        assert learner.due()
        dep.schedule.run_once()
        (u,) = learner.updates()
        ev = json.loads(u["evidence"])
        # 4 same-prompt episodes: leave-one-out baselines for all, rewards 0,1,0,1: every call trains
        assert (u["version"], ev["rewards"], ev["calls"], ev["stale"], ev["no_baseline"]) == (1, 4, 4, 0, 0)
        assert ev["parent"] == 0 and ev["metrics"]["num_transitions"] == 4 and ev["metrics"]["grad_norm"] > 0
        assert "kl" in ev["metrics"]  # train.beta > 0: the KL to the reference is in the loss
        assert lora_b(Path(u["checkpoint"])) > 0  # the optimizer stepped (LoRA B starts at zero)
        assert not learner.due() and learner.pending() == []
        assert dep.gateway.policy == "app-serve-v1"  # promoted: what serves from here
        consumed = sqlite3.connect(dep.store.path).execute("SELECT COUNT(*), MIN(version) FROM learn_consumed")
        assert consumed.fetchone() == (4, 1)
        second = traffic(dep, 2, prompt="What is 3 + 3?")
        dep.gateway.capture.flush()
        reward_all(dep, second, salt="b")  # pending, not yet due: the restart must neither lose nor redo them
        step = dep.schedule.learner.trainer().global_step
    finally:
        dep.close()
    assert step == 1
    cfg.learn.poll_seconds = 0.2  # from here the background thread runs the updates on its schedule
    dep = deployment.start(cfg, d, host="127.0.0.1", port=0, api_key=None, retention_s=3600,
                           scorer=every_one_better)
    try:
        learner = dep.schedule.learner
        assert learner.version == 1 and len(learner.pending()) == 2  # update 1 not redone, the 2 new kept
        assert learner.trainer().global_step == 1  # resumed from update 1's checkpoint
        more = traffic(dep, 2, prompt="What is 3 + 3?")
        dep.gateway.capture.flush()
        reward_all(dep, more, salt="c")
        wait_for(lambda: learner.version == 2)
        assert [u["version"] for u in learner.updates()] == [1, 2]
        ev = json.loads(learner.updates()[1]["evidence"])
        # version 1 served these calls, and update 2 trains from it: 0 versions old, kept
        assert (ev["rewards"], ev["calls"], ev["stale"], ev["parent"]) == (4, 4, 0, 1)
        assert learner.trainer().global_step == 2
        # Calls of an adapter more than K versions old are left out and counted: the base model served `late`,
        # and the update after version 2 reads them 2 > K = 1 versions old.
        reward_all(dep, late, salt="d")
        wait_for(lambda: not learner.pending())
        left = dep.schedule.last
        assert (left.version, left.rewards, left.calls, left.stale) == (None, 4, 0, 4)
        assert dep.schedule.failures == 0
        assert learner.version == 2 and learner.trainer().global_step == 2  # nothing trained, no adapter made
        rows = sqlite3.connect(dep.store.path).execute("SELECT version FROM learn_consumed ORDER BY rowid")
        assert [r[0] for r in rows] == [1] * 4 + [2] * 4 + [None] * 4  # each read once, by the update it names
    finally:
        dep.close()


def test_the_gate_promotes_a_better_candidate_and_rejects_a_worse_one_end_to_end(tmp_path):
    """The eval machinery scores each adapter on data.eval's 3 tasks through the agent (seeded per task); the
    reward is deterministic: 1 where the adapter serving the eval call is version 1 (served there as app-iter1).
    Each decision scores the serving adapter again, both sides with that decision's seeds, new ones each time."""
    cfg = project(tmp_path, every=2)
    scored = []
    # the gate serve starts by default: promotion.eval_scorer on the serving backend itself (lent to the eval)
    dep = deployment.start(cfg, tmp_path / "serve", host="127.0.0.1", port=0, api_key=None, retention_s=3600)
    scorer = dep.schedule.promoter.scorer

    def recorded(candidate, serving, draw):  # (candidate version, serving version, draw) of each decision
        scored.append((candidate[1], serving[1], draw))
        return scorer(candidate, serving, draw)

    dep.schedule.promoter.scorer = recorded
    loads, load = [], dep.server.load_adapter

    def seen(name, path, **kw):  # the real load, with the names it was given kept
        loads.append(name)
        return load(name, path, **kw)

    dep.server.load_adapter = seen
    try:
        learner = dep.schedule.learner
        calls = traffic(dep, 4)
        dep.gateway.capture.flush()
        reward_all(dep, calls[:2])
        dep.schedule.run_once()  # version 1: scores 1,1,1 against the base model's 0,0,0
        assert dep.gateway.policy == "app-serve-v1"  # promoted: hot-loaded, every call routed to it
        # the eval ran on the serving backend (no second one): the candidate loaded into it as app-iter1 for the
        # gate, and unloaded after; the promoted copy (app-serve-v1) stays
        assert loads == ["app-iter1", "app-serve-v1"] and served_models(dep) == ["builtin:tiny-arith", "app-serve-v1"]
        client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key=dep.api_key, max_retries=0)
        reply = client.chat.completions.create(model="gpt-4o-mini", max_tokens=2,
                                               messages=[{"role": "user", "content": "What is 1 + 1?"}])
        assert reply.model == "app-serve-v1"
        reward_all(dep, calls[2:])
        dep.schedule.run_once()  # version 2: scores 0,0,0 against version 1's 1,1,1
        assert learner.version == 2 and dep.gateway.policy == "app-serve-v1"  # rejected: v1 still serves
        promoted, rejected = gate.decisions(dep.store.path)
        assert (promoted.candidate, promoted.serving, promoted.promoted) == ("app-serve-v1", "builtin:tiny-arith",
                                                                            True)
        assert promoted.candidate_scores == [1.0] * 3 and promoted.serving_scores == [0.0] * 3
        assert (rejected.candidate, rejected.serving, rejected.promoted) == ("app-serve-v2", "app-serve-v1", False)
        assert rejected.candidate_scores == [0.0] * 3 and rejected.mean_difference == -1.0
        # The rejected candidate is never trained on: the next update starts again from what serves (version 1's
        # checkpoint), so version 3's parent is 1; ages are counted in the tree of versions (2 -> 1 -> 0, 3 -> 1)
        assert learner.parent == 1 and learner.trainer().global_step == 1
        more = traffic(dep, 2)
        dep.gateway.capture.flush()
        reward_all(dep, more, salt="m")
        dep.schedule.run_once()  # version 3, from version 1: scores 0,0,0, rejected
        assert learner.version == 3 and json.loads(learner.updates()[-1]["evidence"])["parent"] == 1
        # from version 1 (rejected, 3 is dropped): the base model, 2 and 3 are each one update away
        assert learner.parent == 1 and learner.versions() == (
            {"builtin:tiny-arith": 0, "app-serve-v1": 1, "app-serve-v2": 0, "app-serve-v3": 0}, 1)
        assert scored == [(1, 0, 0), (2, 1, 1), (3, 1, 2)]  # v1 scored again against v2 and v3, new draws
        assert loads[2:] == ["app-iter2", "app-iter1", "app-iter3", "app-iter1"]
        assert served_models(dep) == ["builtin:tiny-arith", "app-serve-v1"]  # rejected candidates never stay
        assert len({draw_seed(cfg.run.seed, d) for d in range(3)}) == 3
    finally:
        dep.close()
    dep = deployment.start(cfg, tmp_path / "serve", host="127.0.0.1", port=0, api_key=None, retention_s=3600)
    try:
        assert dep.gateway.policy == "app-serve-v1"  # a restart serves what was promoted last
        assert dep.schedule.learner.parent == 1  # ... and trains from it, not from the rejected version 3
        dep.schedule.learner.follow(3)  # seen from 3: 1 is one update away, the base model and 2 (a sibling) two
        assert dep.schedule.learner.versions() == (
            {"builtin:tiny-arith": 0, "app-serve-v1": 1, "app-serve-v2": 0, "app-serve-v3": 2}, 2)
    finally:
        dep.close()


def test_a_batch_whose_update_keeps_failing_is_quarantined_and_learning_goes_on(tmp_path, monkeypatch):
    """A real failing update (the trainer's step raises, as a bad batch would): it is retried, its rewards stay
    unread, until learn.max_update_failures in a row; then they are consumed untrained with the error as the
    reason, counted, and the next batch trains. due() counts unread rewards with one query, by arrival seq."""
    from lightning_sdk.train.trainer import GRPOTrainer

    cfg = project(tmp_path)
    cfg.learn.max_update_failures = 2
    dep = deployment.start(cfg, tmp_path / "serve", host="127.0.0.1", port=0, api_key=None, retention_s=3600,
                           scorer=no_gate)
    try:
        learner, ledger = dep.schedule.learner, dep.ledger
        bad = traffic(dep, 4)
        dep.gateway.capture.flush()
        reward_all(dep, bad)
        ledger.give({"episode_id": bad[0], "value": 1.0, "name": "thumbs"})  # another name: not counted
        assert learner.due() and ledger.unread_count("reward") == 4

        def broken(self, *args, **kwargs):
            raise RuntimeError("loss is nan")

        real = GRPOTrainer.step
        monkeypatch.setattr(GRPOTrainer, "step", broken)
        with pytest.raises(RuntimeError, match="loss is nan"):
            dep.schedule.run_once()
        assert learner.failed == 1 and len(learner.pending()) == 4  # retried next poll: nothing consumed
        u = dep.schedule.run_once()  # the 2nd failure in a row: quarantined, not raised
        assert (u.version, u.quarantined, learner.quarantined, learner.failed) == (None, 4, 4, 0)
        assert "RuntimeError: loss is nan" in u.reason and not learner.due() and learner.pending() == []
        rows = sqlite3.connect(dep.store.path).execute("SELECT version, reason FROM learn_consumed").fetchall()
        assert len(rows) == 4 and all(v is None and "loss is nan" in r for v, r in rows)
        monkeypatch.setattr(GRPOTrainer, "step", real)
        good = traffic(dep, 4, prompt="What is 3 + 3?")
        dep.gateway.capture.flush()
        reward_all(dep, good, salt="g")
        assert ledger.unread_count("reward") == 4 and ledger.consumed_through("reward") == 5  # 1-4 read, 5 not one
        u = dep.schedule.run_once()
        assert (u.version, u.rewards, u.calls) == (1, 4, 4)  # learning went on after the quarantine
        # arrival seqs: 1-4 the bad batch, 5 the other name's, 6-9 this batch: all read, the other name's not
        assert ledger.consumed_through("reward") == 9 and [r["seq"] for r in ledger.unread("thumbs")] == [5]
    finally:
        dep.close()



def test_kill_9_while_an_update_commits_loses_no_call_or_reward_and_makes_the_update_once(tmp_path):
    """A real `lightning serve --no-store-text` with [learn] is killed (SIGKILL) after update 1's checkpoint is
    written and before its commit: the test holds SQLite's write lock (as a slow disk or another writer would), so
    the learner is waiting on its commit when it dies. Restarted with the same --dir: no answered call or reward is
    lost, a retried reward is not counted twice, update 1 is made once (from the base: its uncommitted checkpoint
    replaced) and each reward is read once. Without text: the records keep token ids and log-probs, no byte of the
    app's prompt is anywhere in the directory, rewards by response id find their calls and the update trains;
    `lightning traces` says the text was not stored."""
    from lightning_sdk.cli import conversation
    from lightning_sdk.gateway.capture import TEXT_ATTRIBUTES
    from lightning_sdk.tracing.records import COMPLETION_IDS, COMPLETION_LOGPROBS, GATEWAY, PROMPT_IDS, TEXT
    from tests.test_serve import ask, traced

    project(tmp_path)
    d = tmp_path / "serve"
    flags = ("--no-store-text", "--set", "learn.poll_seconds=0.1")
    key = {"base_url": None, "api_key": "app-key"}
    proc, key["base_url"] = start_serve(tmp_path / "lightning.toml", d, *flags)
    lock = None
    try:
        client = openai.OpenAI(base_url=key["base_url"], api_key="app-key", max_retries=0)
        episode = "56" * 16
        secret = "Quokka zebra 7731 says hello"  # every call's prompt: one group of 4 same-prompt samples
        ids = [ask(client, traced(episode, f"{i + 1:016x}"), text=secret)[1] for i in range(3)]
        assert ls.feedback(1.0, episode_id=episode, **key).calls == 3  # the calls answered before it are found
        ls.feedback(0.5, call_id=ids[0], name="late", **key)  # another name: stored, never trained on
        for value in (0.0, 1.0, 0.0):  # rewards by response id; the 4th reward makes update 1 due
            response_id, call_id = ask(client, text=secret)
            ids.append(call_id)
            ls.feedback(value, response_id=response_id, **key)  # its 200: committed
        lock = sqlite3.connect(d / deployment.STORE_FILE, isolation_level=None, timeout=30)
        lock.execute("BEGIN IMMEDIATE")  # before the trainer (torch, the model) has even loaded: seconds ahead
        assert lock.execute("SELECT COUNT(*) FROM learn_consumed").fetchone()[0] == 0
        wait_for(lambda: (d / "learn" / "v000001").is_dir(), timeout=60)  # appears whole (atomic_dir)
        time.sleep(0.2)  # ... then the learner waits on its commit
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if lock is not None:
            lock.rollback()
            lock.close()
    db = sqlite3.connect(d / deployment.STORE_FILE)
    assert {r[0] for r in db.execute("SELECT span_id FROM spans WHERE source='gateway'")} == set(ids)
    assert db.execute("SELECT COUNT(*) FROM feedback").fetchone()[0] == 5
    assert db.execute("SELECT COUNT(*) FROM learn_updates").fetchone()[0] == 0  # killed before the commit
    assert db.execute("SELECT COUNT(*) FROM learn_consumed").fetchone()[0] == 0
    cfg = config.load(tmp_path / "lightning.toml")
    cfg.serve.store_text = False
    dep = deployment.start(cfg, d, host="127.0.0.1", port=0, api_key="app-key", retention_s=3600,
                           scorer=every_one_better)
    try:  # the restart, in process (what the command runs), polled here
        key["base_url"] = f"{dep.url}/v1"
        again = ls.feedback(1.0, episode_id=episode, **key)
        assert again.duplicate and again.calls == 3
        assert dep.schedule.learner.version == 0 and len(dep.schedule.learner.pending()) == 4
        u = dep.schedule.run_once()
        assert (u.version, u.rewards, u.calls) == (1, 4, 6) and dep.schedule.learner.trainer().global_step == 1
        ask(openai.OpenAI(base_url=key["base_url"], api_key="app-key", max_retries=0), text=secret)
        dep.gateway.capture.flush()
        calls = [s for s in dep.store.spans("") if s.source == GATEWAY]
    finally:
        dep.close()
    rows = db.execute("SELECT kind, name, value FROM feedback ORDER BY rowid").fetchall()
    assert rows == [("episode_id", "reward", 1.0), ("call_id", "late", 0.5)] + [("response_id", "reward", v)
                                                                                  for v in (0.0, 1.0, 0.0)]
    assert db.execute("SELECT COUNT(*) FROM spans WHERE source='gateway'").fetchone()[0] == len(ids) + 1
    (version, evidence), = db.execute("SELECT version, evidence FROM learn_updates").fetchall()
    assert version == 1 and json.loads(evidence)["rewards"] == 4
    consumed = db.execute("SELECT feedback_id, version FROM learn_consumed ORDER BY feedback_id").fetchall()
    fids = db.execute("SELECT feedback_id FROM feedback WHERE name='reward' ORDER BY feedback_id").fetchall()
    assert consumed == [(f, 1) for f, in fids]  # each reward read once, by update 1
    state = json.loads((d / "learn" / "v000001" / "trainer_state.json").read_text())
    assert state["global_step"] == 1  # redone from the base model, not stepped on top of the lost attempt
    db.close()
    assert len(calls) == 4  # the calls of no episode (by response id, and the last one)
    for c in calls:
        assert c.attributes[TEXT] == "not stored" and not set(TEXT_ATTRIBUTES) & set(c.attributes)
        assert c.attributes[PROMPT_IDS] and len(c.attributes[COMPLETION_IDS]) == len(c.attributes[COMPLETION_LOGPROBS])
        assert conversation(c.attributes) == [("text", "not stored (serve.store_text = false): token ids and "
                                                       "log-probs only")]
    files = [p for p in d.rglob("*") if p.is_file()]
    assert any(p.name == deployment.STORE_FILE for p in files)
    for word in (secret, "Quokka", "zebra 7731"):  # the raw bytes: the store, its WAL, the logs, checkpoints
        assert not [p for p in files if word.encode() in p.read_bytes()], word
