"""Issue 50 (serve at a week's scale) and issue 52 item 6: how `lightning serve`'s costs grow over a week of traffic.

    python benchmarks/serve_week.py                    # the default week; --help for the knobs
    python benchmarks/serve_week.py --calls 3000       # a shorter log (today's quadratic learner: minutes)

A week of traffic compressed in time, through the real serve code: the store (`Store.write_calls`, the records the
gateway writes: prompt and completion token ids, sampler log-probs, the serving policy, the response id), rewards by
`FeedbackLedger.give` (calls of no episode rewarded by response id, as docs/serve.md's first example; episodes by
episode id, some hours late), retention (`retention.prune`, every simulated hour, the window --retention-days), the
learner (`production.learner.Learner` with [learn], real GRPO updates on the builtin tiny model every
--every-rewarded rewards) and the dashboard's serve view (`dashboard.versions.timeline`, live reward included). The
simulated clock moves the timestamps only; every cost is this machine's CPU time (time.process_time).

Printed, as the log grows: the learner's read per update (`Learner.transitions`: the rewards read, the calls they
score and every call's advantage; the GRPO step itself is printed apart, it depends on the model, not the log), the
learner's poll (`Learner.due`), the dashboard's poll (`versions.timeline`, once per simulated hour; the mean of the
last 6), every adapter's live reward read from the whole log (`live_reward.by_adapter`: what each dashboard poll
did before, and what a dashboard's first poll does), a reward's intake (`FeedbackLedger.give`) and a retention pass,
each with its growth exponent fitted over the log sizes (cost ~ calls^k, a least-squares line in log-log); the
store's size by day (it must level off once retention deletes as much as arrives); and calls/s the gateway and
store hold: the real `lightning serve` in this process (deployment.start, on the week's store) on the builtin tiny
model, 8 clients at once, each call recorded, every other one rewarded by its response id.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sqlite3
import tempfile
import time
from pathlib import Path

HOUR = 3600.0
DAY = 24 * HOUR


def write_project(d: Path, every: int) -> Path:
    (d / "eval.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    (d / "train.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    (d / "app.py").write_text("import lightning_sdk as ls\n\n@ls.rollout\ndef solve(task, llm):\n    return ''\n")
    toml = d / "lightning.toml"
    toml.write_text('[run]\nname = "week"\n[agent]\nmodule = "app.py"\n[data]\ntrain = "train.jsonl"\n'
                    'eval = "eval.jsonl"\n[model]\nname = "builtin:tiny-arith"\ndtype = "float32"\n'
                    '[serve]\nmax_batch_size = 8\n[train]\nlora_r = 4\nlr = 0.001\nbeta = 0.0\n'
                    f'[learn]\nevery_rewarded = {every}\nmax_versions_behind = 1000\npoll_seconds = 3600\n')
    return toml


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """The slope of log y against log x (least squares): cost ~ x^k."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


class Traffic:
    """The simulated app: calls (half in episodes of 1-3 calls, half of no episode), each answered by `policy`."""

    def __init__(self, seed: int, prompts: int, prompt_tokens: int, completion_tokens: int):
        self.rng = random.Random(seed)
        self.prompts = [[self.rng.randrange(3, 90) for _ in range(prompt_tokens)] for _ in range(prompts)]
        self.completion_tokens = completion_tokens
        self.n = 0

    def call(self, rollout_id: str, trace_id: str, at: float, policy: str, prompt: list[int]):
        from lightning_sdk.tracing.records import (COMPLETION_IDS, COMPLETION_LOGPROBS, GATEWAY, POLICY, PROMPT_IDS,
                                                   SpanRecord)

        self.n += 1
        end = int(at * 1e9)
        completion = [self.rng.randrange(3, 90) for _ in range(self.completion_tokens)]
        attrs = {PROMPT_IDS: prompt, COMPLETION_IDS: completion, POLICY: policy,
                 COMPLETION_LOGPROBS: [-self.rng.random() * 4 for _ in completion],
                 "gen_ai.request.temperature": 1.0, "gen_ai.response.finish_reasons": ["length"],
                 "gen_ai.response.id": f"chatcmpl-{self.n:012d}", "gen_ai.request.model": "gpt-4o-mini"}
        return SpanRecord(span_id=f"{self.n:016x}", trace_id=trace_id, parent_id=None, rollout_id=rollout_id,
                          attempt=1, component=None, name="chat gpt-4o-mini", start_ns=end - 50_000_000, end_ns=end,
                          status="OK", status_message=None, attributes=attrs, source=GATEWAY)


def prune(path, retention_s, reward_name, now):
    from lightning_sdk.production.retention import prune as one_pass

    return one_pass(path, retention_s=retention_s, max_calls=None, reward_name=reward_name, now=now)


def cpu(fn, *args):
    t = time.process_time()
    out = fn(*args)
    return time.process_time() - t, out


def week(args, root: Path) -> dict:
    from lightning_sdk import config
    from lightning_sdk.dashboard import versions
    from lightning_sdk.production import live_reward
    from lightning_sdk.production.episodes import episode_id
    from lightning_sdk.production.learner import Learner
    from lightning_sdk.production.ledger import FeedbackLedger
    from lightning_sdk.store import Store

    cfg = config.load(write_project(root, args.every_rewarded))
    serve = root / "serve"
    serve.mkdir()
    path = serve / versions.SERVE_FILE
    store = Store(path)
    ledger = FeedbackLedger(path, retention_s=args.retention_days * DAY)
    learner = Learner(cfg, serve, store, ledger, base=cfg.model.name)
    reads: list[float] = []
    orig = learner.transitions

    def timed_transitions(rows):
        t, out = cpu(orig, rows)
        reads.append(t)
        return out

    learner.transitions = timed_transitions  # the learner's read, timed apart from its GRPO step
    traffic = Traffic(args.seed, args.prompts, args.prompt_tokens, args.completion_tokens)
    rng = random.Random(args.seed + 1)
    hours = math.ceil(args.calls / args.calls_per_hour)
    per_hour = args.calls / hours
    start = time.time() - hours * HOUR  # simulated: the week ends now
    later: list[tuple[float, dict]] = []  # (due, feedback body): rewards that come hours late
    points = sorted(p for p in args.points if p <= args.calls)
    rows, days, dash = [], [], []
    updates = steps = 0
    step_s = 0.0
    made = 0.0
    for h in range(hours):
        t0 = start + h * HOUR
        n = int(round(per_hour * (h + 1))) - int(round(per_hour * h))
        batch = []
        gives = []
        policy = learner.adapter_name(learner.version) if learner.version else cfg.model.name
        while len(batch) < n:
            at = t0 + HOUR * len(batch) / max(n, 1)
            prompt = traffic.prompts[rng.randrange(len(traffic.prompts))]
            if rng.random() < args.episode_share:
                trace = f"{rng.getrandbits(128):032x}"
                k = rng.randint(1, 3)
                for i in range(k):
                    batch.append(traffic.call(episode_id(trace), trace, at + i, policy, prompt if i == 0 else
                                              prompt + batch[-1].attributes["lightning.llm.completion_token_ids"]))
                if rng.random() < args.reward_share:
                    later.append((at + rng.uniform(0, args.delay_hours) * HOUR,
                                  {"episode_id": trace, "value": float(rng.random() < 0.5)}))
            else:
                call = traffic.call("", f"{rng.getrandbits(128):032x}", at, policy, prompt)
                batch.append(call)
                if rng.random() < args.reward_share:  # docs/serve.md's first example: by response id, at once
                    gives.append((at + 1, {"response_id": call.attributes["gen_ai.response.id"],
                                           "value": float(rng.random() < 0.5)}))
        store.write_calls(batch)
        due_now = [x for x in later if x[0] < t0 + HOUR]
        later = [x for x in later if x[0] >= t0 + HOUR]
        t = time.process_time()
        for at, body in sorted(gives + due_now, key=lambda x: x[0]):
            ledger.give(body, now=at)
        give_ms = 1e3 * (time.process_time() - t) / max(1, len(gives) + len(due_now))
        prune_s, _ = cpu(prune, path, args.retention_days * DAY, cfg.learn.reward_name, t0 + HOUR)
        for _poll in range(args.polls_per_hour):
            t, due = cpu(learner.due)
            rows.append(("poll", traffic.n, t))
            if due:
                before = len(reads)
                t, up = cpu(learner.update)
                updates += 1
                if up.version is not None:
                    steps += 1
                    step_s += t - sum(reads[before:])
                rows.append(("update", traffic.n, sum(reads[before:]), up.rewards))
        t, view = cpu(versions.timeline, path)  # the dashboard's poll, once an hour of traffic
        dash.append(t)
        while points and traffic.n >= points[0]:
            p = points.pop(0)
            t = sum(dash[-6:]) / len(dash[-6:])
            t2, _ = cpu(live_reward.by_adapter, path)  # every adapter's live reward read from the whole log
            made = sum(v["live"]["episodes"] for v in view["versions"] if v["live"])
            last = [r for r in rows if r[0] == "update"][-3:]
            polls = [r[2] for r in rows if r[0] == "poll"][-args.polls_per_hour * 3:]
            per_reward = sum(r[2] for r in last) / max(1, sum(r[3] for r in last))
            print(f"calls={p:>7} rewards={ledger.count():>6} learner_read_per_update_s="
                  f"{sum(r[2] for r in last) / max(1, len(last)):.4f} "
                  f"learner_read_per_reward_ms={per_reward * 1e3:.3f} "
                  f"learner_poll_ms={1e3 * sum(polls) / max(1, len(polls)):.3f} dashboard_poll_s={t:.4f} "
                  f"live_reward_whole_log_s={t2:.4f} feedback_ms={give_ms:.3f} prune_pass_s={prune_s:.4f} "
                  f"live_units={int(made)}", flush=True)
            days.append({"calls": p, "read": sum(r[2] for r in last) / max(1, len(last)), "per_reward": per_reward,
                         "poll": sum(polls) / max(1, len(polls)), "dash": t, "whole_log": t2,
                         "feedback": give_ms, "prune": prune_s})
        if (h + 1) % 24 == 0 or h == hours - 1:
            db_bytes = sum(f.stat().st_size for f in serve.glob("serve.sqlite*"))
            c = sqlite3.connect(path)
            used = c.execute("PRAGMA page_count").fetchone()[0] - c.execute("PRAGMA freelist_count").fetchone()[0]
            page = c.execute("PRAGMA page_size").fetchone()[0]
            spans = c.execute("SELECT COUNT(*) FROM spans").fetchone()[0]
            fb = c.execute("SELECT COUNT(*) FROM feedback").fetchone()[0]
            c.close()
            print(f"day={(h + 1) / 24:5.2f} calls_sent={traffic.n} calls_stored={spans} feedback_rows={fb} "
                  f"file_mb={db_bytes / 2 ** 20:.2f} used_mb={used * page / 2 ** 20:.2f} updates={updates} "
                  f"steps={steps}", flush=True)
    learner.close()
    ledger.close()
    store.close()
    xs = [d["calls"] for d in days]
    keys = ("read", "per_reward", "poll", "dash", "whole_log", "feedback", "prune")
    out = {k: fit_exponent(xs, [d[k] for d in days]) for k in keys}
    print("exponents (cost ~ calls^k over " + ", ".join(map(str, xs)) + "): " +
          " ".join(f"{k}={v:.2f}" if v is not None else f"{k}=n/a" for k, v in out.items()))
    print(f"grpo_steps={steps} grpo_step_s_mean={step_s / max(1, steps):.3f} (the tiny model; not the log's cost)")
    return out


async def _hammer(url: str, key: str, seconds: float, clients: int) -> tuple[int, int, float]:
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    done = rewarded = 0
    end = time.monotonic() + seconds

    async def one(c: httpx.AsyncClient, i: int):
        nonlocal done, rewarded
        while time.monotonic() < end:
            r = await c.post(f"{url}/v1/chat/completions", headers=headers, json={
                "model": "gpt-4o-mini", "max_tokens": 4,
                "messages": [{"role": "user", "content": f"What is {i} + 1?"}]})
            r.raise_for_status()
            done += 1
            if done % 2 == 0:
                f = await c.post(f"{url}/v1/feedback", headers=headers,
                                 json={"response_id": r.json()["id"], "value": 1.0})
                f.raise_for_status()
                rewarded += 1

    t = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as c:
        await asyncio.gather(*(one(c, i) for i in range(clients)))
    return done, rewarded, time.monotonic() - t


def throughput(args, root: Path) -> None:
    from lightning_sdk import config
    from lightning_sdk.production import deployment

    cfg = config.load(write_project(root, 10 ** 6))
    cfg.learn = None  # serving and recording only: the learner's cost is measured above
    # on the week's store: the writes and the feedback lookups go to a store of the week's size
    dep = deployment.start(cfg, root / "serve", host="127.0.0.1", port=0, api_key=None,
                           retention_s=args.retention_days * DAY)
    try:
        asyncio.run(_hammer(dep.url, dep.api_key, 3, args.clients))  # warm-up
        done, rewarded, wall = asyncio.run(_hammer(dep.url, dep.api_key, args.seconds, args.clients))
    finally:
        dep.close()
    print(f"throughput: backend=builtin:tiny-arith (the real CPU server, max_tokens 4), the week's store, "
          f"clients={args.clients} "
          f"calls={done} rewards={rewarded} wall_s={wall:.1f} calls_per_s={done / wall:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=30000, help="calls over the week (default 30000)")
    p.add_argument("--days", type=float, default=7.0, help="simulated days the calls span (default 7)")
    p.add_argument("--points", type=int, nargs="+", default=[1000, 3000, 10000, 30000])
    p.add_argument("--retention-days", type=float, default=2.0)
    p.add_argument("--reward-share", type=float, default=0.5, help="share of calls/episodes rewarded")
    p.add_argument("--episode-share", type=float, default=0.3, help="share of app requests that are episodes")
    p.add_argument("--delay-hours", type=float, default=6.0, help="episode rewards come up to this late")
    p.add_argument("--every-rewarded", type=int, default=64)
    p.add_argument("--polls-per-hour", type=int, default=4)
    p.add_argument("--prompts", type=int, default=200, help="distinct first prompts (repeats make groups)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20.0, help="the throughput phase's length")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in ("calls", "days", "retention_days", "every_rewarded", "polls_per_hour", "prompts", "prompt_tokens",
                 "completion_tokens", "seconds", "clients"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')}: expected a positive number")
    for name in ("reward_share", "episode_share"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')}: expected a share between 0 and 1")
    args.calls_per_hour = args.calls / (args.days * 24)
    import lightning_sdk

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        print(f"serve_week ({Path(lightning_sdk.__file__).parent}): calls={args.calls} over {args.days:g} days "
              f"({args.calls_per_hour:.0f}/h), retention {args.retention_days:g} days, pid={os.getpid()}", flush=True)
        week(args, root)
        if not args.no_throughput:
            throughput(args, root)


if __name__ == "__main__":
    main()
