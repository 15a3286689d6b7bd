"""How the dashboard, `lightning traces` and the run's own per-iteration store work grow with the run (issue 50).

For each size (rollouts; iterations = rollouts / 50, so 10,000 rollouts are 200 iterations) a run directory is built
directly (tests/big_run.py: the project's Store, no model), a real `lightning dashboard` serves it on 127.0.0.1,
and each page's API route is timed with a real HTTP client (median of --repeats after one warm-up): the runs page,
a run's page (its summary and its first page of rollouts), rollout pages sorted and filtered, a deep page, and a
rollout page. Then `lightning traces` on the same store (a fresh process each: what a user waits for). Each route's
growth exponent k is fitted over the sizes (time ~ rollouts^k, least squares in log-log): ~0 is constant, 1 a
full scan.

--before DIR (a checkout of other code, e.g. `git worktree add /tmp/before main`) pairs every figure: the same run
is served by both trees' dashboards at once (its copy for DIR without the indexes DIR's store does not make, as
DIR's own run would have it) and each request alternates between them, so a loaded machine slows both alike.

The collector's side (--collector N): a run's store grown iteration by iteration to N rollouts, and each
iteration's store work timed as the runtime does it: its rollouts started and finished, its calls and spans
written, then the end-of-iteration reads (each succeeded rollout's record and spans, made into transitions:
runtime/iteration.transitions_of), and the dashboard's poll of the run page over HTTP while it grows (summary and
the first page of rollouts). With --before, two stores grow in lockstep, one written by each tree's Store. The
growth from the first tenth of the iterations to the last says whether an iteration's cost grows with the store.

    python benchmarks/dashboard_scale.py                       # 1k, 3k, 10k, 30k; collector to 10k
    python benchmarks/dashboard_scale.py --sizes 1000 10000 --before /tmp/before
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.big_run import RunWriter, build_run  # noqa: E402

from lightning_sdk import credit  # noqa: E402
from lightning_sdk.store import Store  # noqa: E402
from lightning_sdk.transitions import to_transitions  # noqa: E402

RUN = "big"


@contextlib.contextmanager
def dashboard(tree: Path, root: Path):
    """`lightning dashboard` of the code in `tree` over `root`: an httpx client with its key."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(root),
                             "--port", "0"], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline()
        if "http://127.0.0.1:" not in line:
            raise SystemExit(f"the dashboard of {tree} did not start: {line}{proc.stdout.read()}")
        url = line.split(" at ", 1)[1].split()[0]
        base, token = url.split("/?", 1)[0], url.split("token=", 1)[1]
        with httpx.Client(base_url=base, cookies={f"lightning_dashboard_{base.rsplit(':', 1)[1]}": token},
                          timeout=300) as client:
            yield client
    finally:
        proc.terminate()
        proc.wait(30)


def routes(run: str, last: str, eval_id: str, iterations: int, total: int) -> dict[str, tuple[str, dict]]:
    """What each page asks (static/app.js): the runs page /api/runs; a run's page /api/summary and /api/rollouts
    (limit 50, its filters and sorts); a rollout page /api/rollout."""
    page = {"run": run, "limit": 50}
    return {
        "runs page (/api/runs)": ("/api/runs", {}),
        "run page: summary": ("/api/summary", {"run": run}),
        "run page: rollouts, newest": ("/api/rollouts", page),
        "rollouts: deep page (offset n/2)": ("/api/rollouts", {**page, "offset": total // 2}),
        "rollouts: sort reward": ("/api/rollouts", {**page, "sort": "reward"}),
        "rollouts: sort calls": ("/api/rollouts", {**page, "sort": "calls"}),
        "rollouts: sort seconds": ("/api/rollouts", {**page, "sort": "seconds"}),
        "rollouts: status failed": ("/api/rollouts", {**page, "status": "failed"}),
        "rollouts: phase eval": ("/api/rollouts", {**page, "phase": "eval"}),
        "rollouts: one iteration": ("/api/rollouts", {**page, "iteration": iterations // 2}),
        "rollouts: component": ("/api/rollouts", {**page, "component": "solver"}),
        "rollouts: search text": ("/api/rollouts", {**page, "q": "answer is 42"}),
        "rollout page (train, group explained)": ("/api/rollout", {"run": run, "id": last}),
        "rollout page (eval)": ("/api/rollout", {"run": run, "id": eval_id}),
        "the page itself (/)": ("/", {}),
    }


def get(client: httpx.Client, path: str, params: dict) -> float:
    t = time.perf_counter()
    r = client.get(path, params=params)
    took = time.perf_counter() - t
    if r.status_code != 200:
        raise SystemExit(f"{path} {params}: {r.status_code} {r.text[:300]}")
    return took


def time_routes(clients: list[httpx.Client], table: dict[str, tuple[str, dict]],
                repeats: int) -> list[dict[str, float]]:
    """Median seconds per route for each client, the clients' requests alternating, after one warm-up each."""
    out: list[dict[str, float]] = [{} for _ in clients]
    for name, (path, params) in table.items():
        times: list[list[float]] = [[] for _ in clients]
        for k in range(repeats + 1):
            for c in (clients if k % 2 else clients[::-1]):
                took = get(c, path, params)
                if k:
                    times[clients.index(c)].append(took)
        for i in range(len(clients)):
            out[i][name] = statistics.median(times[i])
    return out


def time_traces(trees: list[Path], roots: list[Path], last: str, checkpoint: str,
                repeats: int) -> list[dict[str, float]]:
    """`lightning traces` as a user runs it (a fresh process), each tree's on its own copy, alternating."""
    out: list[dict[str, float]] = [{} for _ in trees]
    for name, args in (("traces (list)", []), ("traces --rollout", ["--rollout", last]),
                       ("traces --checkpoint", ["--checkpoint", checkpoint]), ("(python startup and imports)", None)):
        times: list[list[float]] = [[] for _ in trees]
        for _ in range(repeats):
            for i, (tree, root) in enumerate(zip(trees, roots)):
                env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
                cmd = ([sys.executable, "-m", "lightning_sdk.cli", "traces", "--run-dir", str(root / RUN), *args]
                       if args is not None else [sys.executable, "-c", "import lightning_sdk.cli, lightning_sdk.store"])
                t = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, capture_output=True)
                times[i].append(time.perf_counter() - t)
        for i in range(len(trees)):
            out[i][name] = statistics.median(times[i])
    return out


def exponent(sizes: list[int], times: list[float]) -> float:
    xs, ys = [math.log(s) for s in sizes], [math.log(max(t, 1e-6)) for t in times]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def schema_indexes(tree: Path) -> set[str]:
    return set(re.findall(r"CREATE INDEX IF NOT EXISTS (\w+)", (tree / "lightning_sdk/store.py").read_text()))


def as_before(db: Path, before: Path) -> None:
    """Leave in `db` only the indexes the `before` tree's store makes: the store its own run would have written."""
    keep = schema_indexes(before)
    with contextlib.closing(sqlite3.connect(db)) as c:
        for (name,) in c.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL").fetchall():
            if name not in keep:
                c.execute(f"DROP INDEX {name}")
        c.commit()


def pages(sizes: list[int], repeats: int, keep: Path | None, before: Path | None) -> None:
    trees = [ROOT] + ([before] if before else [])
    sides = ["this tree"] + (["before"] if before else [])
    results: dict[int, list[dict[str, float]]] = {}
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="dashboard-scale-", dir=keep) as tmp:
            roots = [Path(tmp) / side.replace(" ", "-") for side in sides]
            iterations = max(2, size // 50)
            t = time.perf_counter()
            run = build_run(roots[0] / RUN, rollouts=size, iterations=iterations, eval_tasks=max(2, size // 100))
            built = time.perf_counter() - t
            db = roots[0] / RUN / "store.sqlite"
            with Store(db, read_only=True) as store:
                eval_id = store.rollouts(phase="eval", limit=1)[0].rollout_id
            if before:
                shutil.copytree(roots[0], roots[1])
                as_before(roots[1] / RUN / "store.sqlite", before)
            print(f"\n{size:,} rollouts asked: {run.rollouts:,} rollouts, {run.spans:,} spans, {iterations} "
                  f"iterations, store {db.stat().st_size / 2**20:.0f} MiB, built in {built:.1f} s", flush=True)
            with contextlib.ExitStack() as stack:
                clients = [stack.enter_context(dashboard(tree, root)) for tree, root in zip(trees, roots)]
                table = routes(RUN, run.last_rollout, eval_id, iterations, run.rollouts)
                results[size] = time_routes(clients, table, repeats)
            checkpoint = sorted((roots[0] / RUN / "checkpoints").iterdir())[-1].name
            for side, figures in zip(results[size], time_traces(trees, roots, run.last_rollout, checkpoint,
                                                                max(1, repeats // 2))):
                side.update(figures)
            for name in results[size][0]:
                print(f"  {name:40s} " + "  ".join(f"{side} {r[name] * 1000:8.1f} ms"
                                                   for side, r in zip(sides, results[size])), flush=True)
    for i, side in enumerate(sides):
        print(f"\n{side}: ms per request (median), and the exponent k of time ~ rollouts^k")
        print("route | " + " | ".join(f"{s:,}" for s in sizes) + " | k")
        print("--- | " + " | ".join("---" for _ in sizes) + " | ---")
        for name in results[sizes[0]][i]:
            times = [results[s][i][name] for s in sizes]
            k = exponent(sizes, times) if len(sizes) > 1 else float("nan")
            print(f"{name} | " + " | ".join(f"{t * 1000:.1f}" for t in times) + f" | {k:.2f}")
    big = results[sizes[-1]]
    for side, r in zip(sides, big):
        slowest = max((v, k) for k, v in r.items() if not k.startswith(("traces", "(")))
        print(f"dashboard_scale: side={side.replace(' ', '_')} rollouts={sizes[-1]} "
              f"runs_page_ms={r['runs page (/api/runs)'] * 1000:.1f} "
              f"rollout_page_ms={r['rollout page (train, group explained)'] * 1000:.1f} "
              f"slowest_route_ms={slowest[0] * 1000:.1f} ({slowest[1]})")


def old_store_class(before: Path):
    """The `before` tree's Store class, loaded beside this tree's (its imports are this tree's: agent, records)."""
    spec = importlib.util.spec_from_file_location("before_store", before / "lightning_sdk/store.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["before_store"] = module
    spec.loader.exec_module(module)
    return module.Store


def collector(total: int, every: int, keep: Path | None, before: Path | None) -> None:
    """Each iteration's store work, as the run grows to `total` rollouts (see the module's docstring)."""
    rule = credit.resolve("lightning_rl")
    per_iteration = 52
    iterations = max(2, total // per_iteration)
    trees = [ROOT] + ([before] if before else [])
    sides = ["this tree"] + (["before"] if before else [])
    classes = [Store] + ([old_store_class(before)] if before else [])
    print(f"\ncollector: one run to {total:,} rollouts, {per_iteration} an iteration; ms per iteration. write: its "
          f"rollouts started, calls and spans written, finished; read: the end-of-iteration records and spans made "
          f"into transitions; poll: the run page over HTTP (summary and the first 50 rollouts)")
    print("iteration | rollouts in store | " + " | ".join(f"{s} write | {s} read | {s} poll" for s in sides))
    print("--- | --- | " + " | ".join("--- | --- | ---" for _ in sides))
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory(prefix="collector-scale-", dir=keep) as tmp, contextlib.ExitStack() as stack:
        stores, writers, clients = [], [], []
        for side, tree, cls in zip(sides, trees, classes):
            root = Path(tmp) / side.replace(" ", "-")
            (root / RUN).mkdir(parents=True)
            store = stack.enter_context(cls(root / RUN / "store.sqlite"))
            stores.append(store)
            writers.append(RunWriter(store, per_iteration=per_iteration, eval_tasks=max(2, total // 100)))
            writers[-1].eval_pass(0, "untrained")
            clients.append(stack.enter_context(dashboard(tree, root)))
        for it in range(1, iterations + 1):
            row: list = [it, writers[0].rollouts]
            for store, w, client in zip(stores, writers, clients):
                t = time.perf_counter()
                ok, _, _ = w.iteration(it)
                write = time.perf_counter() - t
                t = time.perf_counter()
                for rid in ok:  # runtime/iteration.transitions_of, per succeeded rollout
                    to_transitions(store.rollout(rid), store.spans(rid), credit=rule, components=[],
                                   error_reward=-1.0)
                read = time.perf_counter() - t
                poll = get(client, "/api/summary", {"run": RUN}) + get(client, "/api/rollouts",
                                                                       {"run": RUN, "limit": 50})
                row += [write, read, poll]
            rows.append(tuple(row))
            if it == 1 or it % every == 0 or it == iterations:
                print(f"{it} | {row[1]} | " + " | ".join(f"{v * 1000:.1f}" for v in row[2:]), flush=True)
    tenth = max(1, len(rows) // 10)
    for i, side in enumerate(sides):
        for j, name in enumerate(("write", "read", "poll")):
            col = 2 + 3 * i + j
            a = statistics.median(r[col] for r in rows[:tenth])
            b = statistics.median(r[col] for r in rows[-tenth:])
            k = exponent([r[1] for r in rows], [r[col] for r in rows])
            print(f"collector: side={side.replace(' ', '_')} {name} first tenth {a * 1000:.1f} ms, last tenth "
                  f"{b * 1000:.1f} ms, ratio={b / a:.2f}, k={k:.2f} (time ~ rollouts in store^k)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 10000, 30000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--collector", type=int, default=10000, help="grow one run to this many rollouts (0: skip)")
    p.add_argument("--every", type=int, default=20, help="print the collector's curve every N iterations")
    p.add_argument("--no-pages", action="store_true", help="only the collector's curve")
    p.add_argument("--before", type=Path, help="a checkout of other code to pair every figure with")
    p.add_argument("--tmp", type=Path, help="where to build the runs (default: the system's temporary folder)")
    a = p.parse_args()
    if a.before is not None and not (a.before / "lightning_sdk/store.py").is_file():
        p.error(f"--before {a.before}: expected a checkout of this project (no lightning_sdk/store.py there)")
    if not a.no_pages:
        pages(sorted(a.sizes), a.repeats, a.tmp, a.before)
    if a.collector:
        collector(a.collector, a.every, a.tmp, a.before)


if __name__ == "__main__":
    main()
