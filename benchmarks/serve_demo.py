"""Issue 39, item 6: `lightning serve` learning from a deployed app's traffic, on the CPU, in one command.

    python benchmarks/serve_demo.py            # ~10 min on 2 cores; --help for the knobs

The default job's parts (README: the builtin tiny model, cookbook/arith's agent and tasks, lightning.toml's [train]),
served by the real `lightning serve` command (a subprocess, with [learn]). An app sends the agent's questions at a
steady rate, one episode each; a feedback client sends each call's reward (cookbook/arith's own: the bare number)
after a random delay. Then a period of poisoned feedback (1 - reward), then honest feedback again (`after`: what
serves once the poisoned candidates were judged). In the middle of the honest period the server
is killed with SIGKILL and restarted on the same --dir and port; the app holds new calls until it answers and
retries the calls in flight, the feedback client the rewards it could not send.

Printed: live reward (the true one, computed here) by served version and by time window, every gate decision, and
the kill -9 check (every answered call and every acknowledged reward stored, updates 1..n each once, no reward read
twice). Written: benchmarks/results/serve_demo.json. Wall time is real time; nothing is simulated but the app.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "cookbook/arith/data/train.jsonl"
KEY = "demo-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_project(d: Path, args) -> Path:
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
    if args.eval_tasks < len(tasks):  # a seeded sample: the first ones are all "0 + x", not typical
        tasks = random.Random(args.seed).sample(tasks, args.eval_tasks)
    (d / "eval.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    toml = d / "lightning.toml"
    # lightning.toml's default job (model, agent, tasks, [train]); [learn] added.
    toml.write_text(f'''[run]
name = "demo"
dir = "{d / 'run'}"
seed = {args.seed}
[agent]
module = "{ROOT / 'cookbook/arith/agent.py'}"
[data]
train = "{TASKS}"
eval = "{d / 'eval.jsonl'}"
[model]
name = "builtin:tiny-arith"
dtype = "float32"
[serve]
backend = "cpu"
[train]
lr = 2e-3
lora_r = 8
lora_alpha = 16
target_modules = ["all-linear", "lm_head"]
epochs = 2
beta = 0.0
loss_norm = "rollout"
micro_batch_size = 64
[learn]
every_rewarded = {args.every}
max_versions_behind = {args.behind}
poll_seconds = 0.5
gate_margin = {args.margin}
''')
    return toml


class Server:
    """`lightning serve` as a subprocess; its output kept (a thread reads it, so the pipe never fills)."""

    def __init__(self, toml: Path, directory: Path, port: int):
        self.toml, self.directory, self.port, self.lines = toml, directory, port, []

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", "LIGHTNING_SERVE_KEY": KEY}
        self.proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "serve", "-c", str(self.toml),
                                      "--dir", str(self.directory), "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("serving "):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or self.proc.poll() is not None:
            raise SystemExit("lightning serve did not start:\n" + "\n".join(self.lines[-30:]))


class Demo:
    def __init__(self, args, server: Server):
        self.args, self.server = args, server
        self.base = f"http://127.0.0.1:{server.port}/v1"
        self.tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
        self.rng = random.Random(args.seed)
        self.calls: list[dict] = []  # answered: t, call id, policy, true reward, phase
        self.acked: dict[str, float] = {}  # call id -> the value a 200 acknowledged
        self.retried_calls = self.retried_rewards = 0
        self.pending: set[asyncio.Task] = set()
        self.t0 = time.monotonic()
        self.poison_at: float | None = None
        self.after_at: float | None = None
        self.killed_at: float | None = None

    async def call(self, client: httpx.AsyncClient, task: dict, phase: str) -> None:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": task["question"]}],
                "temperature": 1.0, "max_tokens": 8}  # what cookbook/arith/agent.py sends
        headers = {"Authorization": f"Bearer {KEY}", "traceparent": f"00-{uuid.uuid4().hex}-{'cd' * 8}-01"}
        while True:
            try:
                r = await client.post(f"{self.base}/chat/completions", json=body, headers=headers, timeout=120)
                r.raise_for_status()
                break
            except httpx.HTTPError:  # the server is down (killed): the app tries again
                self.retried_calls += 1
                await asyncio.sleep(0.5)
        reply = r.json()
        text = reply["choices"][0]["message"]["content"] or ""
        reward = float(text.strip() == task["answer"])  # cookbook/arith's @reward
        call_id = r.headers["x-lightning-call-id"]
        self.calls.append({"t": time.monotonic() - self.t0, "call_id": call_id, "policy": reply["model"],
                           "reward": reward, "phase": phase})
        await asyncio.sleep(self.rng.uniform(0, self.args.max_delay))  # the outcome is known later
        sent = 1.0 - reward if phase == "poison" else reward
        while True:
            try:
                f = await client.post(f"{self.base}/feedback", json={"call_id": call_id, "value": sent},
                                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
                if f.status_code == 200:
                    self.acked[call_id] = sent
                    return
                raise SystemExit(f"feedback refused: {f.status_code} {f.text}")
            except httpx.HTTPError:
                self.retried_rewards += 1
                await asyncio.sleep(0.5)

    async def traffic(self) -> None:
        a = self.args
        total = a.honest + a.poison + a.after
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            for i in range(total):
                if i == a.honest:
                    self.poison_at = time.monotonic() - self.t0
                if i == a.honest + a.poison:
                    self.after_at = time.monotonic() - self.t0
                if i == a.honest // 2 and a.kill:
                    await self.kill_and_restart()
                task = self.rng.choice(self.tasks)
                phase = "honest" if i < a.honest else "poison" if i < a.honest + a.poison else "after"
                t = asyncio.create_task(self.call(client, task, phase))
                self.pending.add(t)
                t.add_done_callback(self.pending.discard)
                await asyncio.sleep(1 / a.rate)
            while self.pending:
                await asyncio.gather(*list(self.pending))

    async def kill_and_restart(self) -> None:
        self.killed_at = time.monotonic() - self.t0
        os.kill(self.server.proc.pid, signal.SIGKILL)
        self.server.proc.wait()
        self.at_kill = {"answered": len(self.calls), "acked": len(self.acked), "db": counts(self.server.directory)}
        # New calls wait for the restart; calls and rewards in flight retry until it answers, as an app's would.
        await asyncio.to_thread(self.server.start)
        self.restarted_at = time.monotonic() - self.t0


def counts(d: Path) -> dict:
    db = sqlite3.connect(d / "serve.sqlite", timeout=30)
    try:
        q = lambda sql: db.execute(sql).fetchone()[0]  # noqa: E731
        return {"calls": q("SELECT COUNT(*) FROM spans WHERE source='gateway'"),
                "feedback": q("SELECT COUNT(*) FROM feedback"),
                "updates": q("SELECT COUNT(*) FROM learn_updates"),
                "consumed": q("SELECT COUNT(*) FROM learn_consumed")}
    finally:
        db.close()


def wait_learned(d: Path, timeout: float) -> None:
    """Until every reward is read by an update (or the timeout): the last update and its gate done."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        c = counts(d)
        if c["consumed"] >= c["feedback"]:
            return
        time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=8.0, help="calls per second the app sends")
    p.add_argument("--honest", type=int, default=3200, help="calls with true rewards")
    p.add_argument("--poison", type=int, default=800, help="calls after them whose rewards are inverted")
    p.add_argument("--after", type=int, default=1200, help="calls after those, with true rewards again")
    p.add_argument("--max-delay", type=float, default=5.0, help="each reward arrives after U(0, this) seconds")
    p.add_argument("--every", type=int, default=128, help="learn.every_rewarded")
    p.add_argument("--behind", type=int, default=2, help="learn.max_versions_behind")
    p.add_argument("--margin", type=float, default=0.05, help="learn.gate_margin")
    p.add_argument("--eval-tasks", type=int, default=100, help="data.eval: N of the default job's 100 tasks (all: "
                                                                   "as lightning.toml's eval)")
    p.add_argument("--window", type=float, default=30.0, help="seconds per row of the time table")
    p.add_argument("--no-kill", dest="kill", action="store_false", help="skip the kill -9 in the middle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve_demo.json")
    args = p.parse_args()
    started = time.monotonic()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory(prefix="serve-demo-") as tmp:
        d = Path(tmp)
        toml = write_project(d, args)
        server = Server(toml, d / "serve", free_port())
        server.start()
        demo = Demo(args, server)
        asyncio.run(demo.traffic())
        traffic_s = time.monotonic() - demo.t0
        wait_learned(server.directory, 300)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=300)
        result = report(demo, server, args, traffic_s)
    result.update(wall_s=round(time.monotonic() - started, 1), loadavg_before=load_before,
                  loadavg_after=Path("/proc/loadavg").read_text().split()[:3], args=vars(args) | {"out": str(args.out)})
    print(f"\nwall {result['wall_s']:.0f} s; load average before {' '.join(load_before)}, after "
          f"{' '.join(result['loadavg_after'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out}")


def report(demo: Demo, server: Server, args, traffic_s: float) -> dict:
    db = sqlite3.connect(server.directory / "serve.sqlite")
    db.row_factory = sqlite3.Row
    updates = [dict(r) for r in db.execute("SELECT version, made_at, adapter, evidence FROM learn_updates "
                                           "ORDER BY version")]
    decisions = [dict(r) for r in db.execute("SELECT decided_at, candidate, serving, promoted, evidence FROM "
                                             "promotions ORDER BY rowid")]
    stored_calls = {r[0] for r in db.execute("SELECT span_id FROM spans WHERE source='gateway'")}
    stored_fb = {r["call_id"]: r["value"] for r in db.execute("SELECT call_id, value FROM feedback")}
    consumed = [r[0] for r in db.execute("SELECT feedback_id FROM learn_consumed")]
    read_by = defaultdict(list)  # version -> the call ids its rewards named
    for r in db.execute("SELECT f.call_id, c.version FROM learn_consumed c JOIN feedback f USING (feedback_id)"):
        read_by[r[1]].append(r[0])
    fb_ids = {r[0] for r in db.execute("SELECT feedback_id FROM feedback")}
    db.close()

    by_version: dict[str, list[float]] = defaultdict(list)
    for c in demo.calls:
        by_version[(c["policy"], c["phase"])].append(c["reward"])
    print("\nLive reward (true, computed by the app) by the adapter that served the call:")
    print(f"{'served by':<28} {'phase':<7} {'calls':>6} {'reward':>7}")
    rows_v = []
    for (policy, phase), rs in sorted(by_version.items(), key=lambda kv: min(c["t"] for c in demo.calls
                                                                            if c["policy"] == kv[0][0])):
        rows_v.append({"policy": policy, "phase": phase, "calls": len(rs), "reward": sum(rs) / len(rs)})
        print(f"{policy:<28} {phase:<7} {len(rs):>6} {sum(rs) / len(rs):>7.3f}")

    print(f"\nLive reward by {args.window:g} s window (poisoned feedback from t = {demo.poison_at:.0f} s"
          + (f", honest again from t = {demo.after_at:.0f} s" if demo.after_at is not None else "")
          + (f"; kill -9 at t = {demo.killed_at:.0f} s, serving again at {demo.restarted_at:.0f} s)"
             if demo.killed_at is not None else ")"))
    print(f"{'window':<12} {'calls':>6} {'reward':>7}  served by")
    rows_t = []
    for w in range(int(max(c["t"] for c in demo.calls) // args.window) + 1):
        cs = [c for c in demo.calls if w * args.window <= c["t"] < (w + 1) * args.window]
        if not cs:
            continue
        served = sorted({c["policy"] for c in cs})
        mean = sum(c["reward"] for c in cs) / len(cs)
        rows_t.append({"from_s": w * args.window, "calls": len(cs), "reward": mean, "served_by": served})
        print(f"{w * args.window:>4.0f}-{(w + 1) * args.window:<4.0f} s {len(cs):>6} {mean:>7.3f}  {', '.join(served)}")

    print("\nGate decisions (candidate vs serving on the eval tasks, paired; promote iff lower bound >= -margin):")
    rows_g = []
    t_wall0 = time.time() - (time.monotonic() - demo.t0)
    phase_of = {c["call_id"]: c["phase"] for c in demo.calls}
    for dcs in decisions:
        ev = json.loads(dcs["evidence"])
        t = dcs["decided_at"] - t_wall0
        read = read_by.get(int(dcs["candidate"].rsplit("-v", 1)[1]), [])
        poisoned = sum(1 for c in read if phase_of.get(c) == "poison")
        phase = f"{poisoned}/{len(read)} rewards poisoned"
        rows_g.append({"t_s": t, "candidate": dcs["candidate"], "serving": dcs["serving"],
                       "promoted": bool(dcs["promoted"]), "candidate_mean": _mean(ev["candidate_scores"]),
                       "serving_mean": _mean(ev["serving_scores"]), "lower_bound": ev["lower_bound"],
                       "rewards_read": len(read), "poisoned_read": poisoned})
        print(f"t={t:>5.0f} s  {dcs['candidate']:<14} vs {dcs['serving']:<20} eval {_mean(ev['candidate_scores']):.3f} "
              f"vs {_mean(ev['serving_scores']):.3f}  lower bound {ev['lower_bound']:+.3f}  "
              f"{'PROMOTED' if dcs['promoted'] else 'rejected'} (trained on {phase})")
    print("\nUpdates:")
    for u in updates:
        ev = json.loads(u["evidence"])
        print(f"v{u['version']} (from v{ev.get('parent', u['version'] - 1)}): {ev['rewards']} rewards read, "
              f"{ev['calls']} calls trained, {ev['stale']} stale, {ev['no_baseline']} without a baseline")

    versions = [u["version"] for u in updates]
    answered = {c["call_id"] for c in demo.calls}
    check = {
        "answered_calls": len(answered), "answered_missing_from_store": len(answered - stored_calls),
        "acked_rewards": len(demo.acked),
        "acked_missing_or_changed": sum(1 for k, v in demo.acked.items() if stored_fb.get(k) != v),
        "feedback_rows": len(stored_fb), "updates": versions,
        "updates_each_once": versions == list(range(1, len(versions) + 1)),
        "rewards_read_twice": len(consumed) - len(set(consumed)),
        "rewards_unread_at_end": len(fb_ids - set(consumed)),
        "retried_calls": demo.retried_calls, "retried_rewards": demo.retried_rewards,
        "at_kill": getattr(demo, "at_kill", None),
    }
    print("\nkill -9 check:", json.dumps(check))
    return {"by_version": rows_v, "by_window": rows_t, "gate": rows_g, "check": check, "traffic_s": traffic_s,
            "poison_at_s": demo.poison_at, "after_at_s": demo.after_at, "killed_at_s": demo.killed_at,
            "restarted_at_s": getattr(demo, "restarted_at", None),
            "server_log_tail": server.lines[-20:]}


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


if __name__ == "__main__":
    main()
