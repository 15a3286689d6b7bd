"""Issue 52, items 3 and 11: the serve learner's rewards, measured through the serve store and the Learner (the
API `lightning serve`'s background thread calls), from whichever checkout is on PYTHONPATH:

    PYTHONPATH=/work/before python scripts/serve_attacks/rewards.py     # main as it was
    PYTHONPATH=$PWD python scripts/serve_attacks/rewards.py             # this checkout

Item 3: a store holding a reward of 1e300 (as the ledger accepted it before feedback was bounded; written as the
ledger's own row, so both checkouts read the same store), then honest rewards; two real GRPO updates on the builtin
tiny model: versions made without an optimizer step, whether SQLite can read the evidence (json_extract), and the
largest running baseline the learner's view holds. Item 11: the issue's update (a call rewarded 1.0 by its id and
0.5 with its episode, after another reply to the same prompt rewarded 0.8238) and the reply counted twice in a
leave-one-out baseline (credit last_call, a running baseline of 1/3): the advantages each transition trains with.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402

from lightning_sdk import config  # noqa: E402
from lightning_sdk.production.learner import Learner  # noqa: E402
from lightning_sdk.production.ledger import FeedbackLedger  # noqa: E402
from lightning_sdk.store import Store  # noqa: E402
from lightning_sdk.tracing.records import COMPLETION_IDS, GATEWAY, PROMPT_IDS, SpanRecord  # noqa: E402


class Log:
    """A serve store written as the gateway and the ledger write it."""

    def __init__(self, folder: Path, credit: str = "lightning_rl"):
        folder.mkdir(parents=True)
        serving.write_project(folder, f'[rollout]\ncredit = "{credit}"\n[learn]\nevery_rewarded = 1\n'
                                      f'poll_seconds = 3600\n')
        self.cfg = config.load(folder / "lightning.toml")
        path = folder / "serve.sqlite"
        self.store, self.ledger = Store(path), FeedbackLedger(path)
        self.learner = Learner(self.cfg, folder, self.store, self.ledger, base=self.cfg.model.name)
        self.n, self.now = 0, time.time() - 3600

    def call(self, rollout_id: str, prompt: list[int]) -> SpanRecord:
        self.n += 1
        self.now += 1
        ns = int(self.now * 1e9)
        rec = SpanRecord(span_id=f"{self.n:016x}", trace_id=f"{self.n:032x}", parent_id=None, rollout_id=rollout_id,
                         attempt=1, component=None, name="chat", start_ns=ns - 1000, end_ns=ns, status="OK",
                         status_message=None, source=GATEWAY,
                         attributes={PROMPT_IDS: prompt, COMPLETION_IDS: [1, 2], "gen_ai.response.id": f"r-{self.n}"})
        self.store.write_calls([rec])
        return rec

    def give(self, body: dict) -> None:
        self.now += 1
        self.ledger.give(body, now=self.now)

    def old_reward(self, call: SpanRecord, value: float) -> None:
        """A reward row as a store from before feedback was bounded holds it."""
        self.now += 1
        db = sqlite3.connect(self.store.path)
        with db:
            db.execute("INSERT INTO feedback VALUES (?,?,?,?,?,?,?,?,?)",
                       (f"old-{self.n}", "call_id", call.span_id, call.rollout_id, call.span_id, "reward", value,
                        self.now, self.now))
        db.close()

    def trained(self) -> dict[tuple[str, str], list[float]]:
        kept, adv, _, _ = self.learner.transitions(self.learner.pending())
        out: dict[tuple[str, str], list[float]] = {}
        for t in kept:  # main keyed the advantages by call alone
            out.setdefault((t.rollout_id, t.span_id), []).append(adv.get((t.rollout_id, t.span_id),
                                                                         adv.get(t.span_id)))
        return out

    def close(self) -> None:
        self.learner.close()
        self.ledger.close()
        self.store.close()


def item3(folder: Path) -> None:
    log = Log(folder)
    try:
        x = log.call("", [1, 2, 3])
        log.give({"call_id": x.span_id, "value": 0.5})
        log.old_reward(log.call("", [1, 2, 4]), 1e300)
        first = log.learner.update()
        y = log.call("", [1, 2, 5])
        log.give({"call_id": y.span_id, "value": 1.0})
        second = log.learner.update()
        log.learner.rewards.refresh()
        held = [abs(v) for s in log.learner.rewards.samples.values() for v in (s.before, s.after) if v is not None]
        epochs = log.cfg.train.epochs
        no_step = 0
        for row in log.learner.updates():  # json.loads reads NaN; SQLite does not
            if json.loads(row["evidence"])["metrics"].get("skipped_steps", 0) >= epochs:
                no_step += 1
        db = sqlite3.connect(log.store.path)
        try:
            db.execute("SELECT json_extract(evidence, '$.metrics.loss') FROM learn_updates").fetchall()
            readable = "json_extract reads every row"
        except sqlite3.OperationalError as e:
            readable = f"json_extract: {e}"
        finally:
            db.close()
        made = [u.version for u in (first, second)]
        serving.emit(3, "1e300 then an honest reward, two real updates (tiny model): versions made [update 1, 2]; "
                        "versions made with no optimizer step; the evidence; max |running baseline| held",
                     f"versions {made}; {no_step} made with no step; {readable}; "
                     f"max |baseline| {max(held, default=0.0):.3g}")
    finally:
        log.close()


def item11(folder: Path) -> None:
    a = Log(folder / "a")
    try:  # the update: one call in two samples, read by one update
        y = a.call("", [5])
        a.give({"call_id": y.span_id, "value": 0.8238})
        c1, _ = a.call("ep-" + "a" * 32, [5]), a.call("ep-" + "a" * 32, [5, 9])
        a.give({"call_id": c1.span_id, "value": 1.0})
        a.give({"episode_id": "a" * 32, "value": 0.5})
        got = a.trained()
        own, episode = got[(c1.span_id, c1.span_id)], got[(c1.rollout_id, c1.span_id)]
    finally:
        a.close()
    b = Log(folder / "b", credit="last_call")
    try:  # an episode and its first call both rewarded: one reply; the call's advantage alone (last_call)
        x = b.call("", [1])
        b.give({"call_id": x.span_id, "value": 1 / 3})
        c1, _ = b.call("ep-" + "c" * 32, [5]), b.call("ep-" + "c" * 32, [5, 9])
        b.give({"call_id": c1.span_id, "value": 1.0})
        b.give({"episode_id": "c" * 32, "value": 0.5})
        reply = b.trained()[(c1.span_id, c1.span_id)]
    finally:
        b.close()
    fmt = lambda v: "[" + ", ".join(f"{x:+.4f}" for x in v) + "]"  # noqa: E731
    serving.emit(11, "a call rewarded 1.0 by id and 0.5 with its episode (another reply 0.8238): advantages it "
                     "trains with as (its call sample), (its episode); the call's A when its episode is rewarded "
                     "too (running baseline 1/3: right is 0.667)",
                 f"call sample {fmt(own)}, episode {fmt(episode)}; A = {reply[0]:.3f}")


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        item3(Path(d) / "item3")
        item11(Path(d) / "item11")


if __name__ == "__main__":
    main()
