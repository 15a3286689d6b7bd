"""Garbage-collection pauses in a run's process, the startup heap frozen (as `lightning run` does,
lightning_sdk/heap.py) against left to the collector.

    python benchmarks/gc_pauses.py --iterations 10 --pairs 2

Each run is the default job (lightning.toml: the arith agent in process, 16 concurrent rollouts through the
gateway, the trainer in the same process), without its eval, in a fresh process of its own; the two ways
alternate, pair by pair (which goes first alternates too). The "live" side runs the same code with the freeze
replaced by a block that does nothing. Every collection from the loop's start on is timed on the thread that ran
it (gc.callbacks).

Prints, per run: tracked objects when the loop started, full (generation 2) collections and their longest pause,
the time all collections took per iteration, and the collection phase's seconds per iteration (metrics.jsonl's
collect_s). Last: `ratio=<collect_s per iteration frozen / live, summed over the pairs>`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser()
p.add_argument("--iterations", type=int, default=10)
p.add_argument("--pairs", type=int, default=2)
p.add_argument("--side", choices=["frozen", "live"], help=argparse.SUPPRESS)  # one run, in a child process
args = p.parse_args()


def one_run(side: str) -> dict:
    from rich.console import Console

    from lightning_sdk import config
    from lightning_sdk import metric_names as names
    from lightning_sdk.runtime import Runtime, loop

    pauses: list[tuple[int, float]] = []
    started: dict[int, float] = {}
    tracked: list[int] = []

    def timed(phase: str, info: dict) -> None:
        me = threading.get_ident()
        if not tracked:  # still starting up: the freeze's own collection and those before it are not the loop's
            return
        if phase == "start":
            started[me] = time.perf_counter()
        elif me in started:
            pauses.append((info["generation"], time.perf_counter() - started.pop(me)))

    real = loop.frozen_heap

    @contextlib.contextmanager
    def at_start():  # the loop starts here: count what the collector would walk, then freeze (or not)
        count = len(gc.get_objects())
        with (real() if side == "frozen" else contextlib.nullcontext(0)) as n:
            tracked.append(count)
            yield n

    loop.frozen_heap = at_start
    run_dir = Path(tempfile.mkdtemp(prefix=f"ls-gc-{side}-"))
    cfg = config.override(config.load(ROOT / "lightning.toml"), {
        "run.iterations": args.iterations, "run.dir": str(run_dir), "data.eval": None})
    gc.callbacks.append(timed)
    Runtime(cfg, console=Console(file=io.StringIO())).run()
    gc.callbacks.remove(timed)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "iteration" in r and r.get("phase") != "eval"]
    full = [s for g, s in pauses if g == 2]
    return {"side": side, "tracked": tracked[0], "full": len(full), "full_max_ms": max(full, default=0) * 1e3,
            "gc_ms_per_it": sum(s for _, s in pauses) * 1e3 / len(rows),
            "collect_s_per_it": sum(r[names.timing("collect_s")] for r in rows) / len(rows)}


if args.side:
    print(json.dumps(one_run(args.side)))
    sys.exit(0)

runs: list[dict] = []
for i in range(args.pairs):
    for side in (("frozen", "live") if i % 2 == 0 else ("live", "frozen")):
        out = subprocess.run([sys.executable, __file__, "--side", side, "--iterations", str(args.iterations)],
                             cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"the {side} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append(r)
        print(f"pair {i + 1} {side:>6}: {r['tracked']:,} objects tracked at the loop's start; {r['full']} full "
              f"collections, longest {r['full_max_ms']:.0f} ms; all collections {r['gc_ms_per_it']:.0f} ms an "
              f"iteration; collect {r['collect_s_per_it']:.2f} s an iteration", flush=True)
total = {s: sum(r["collect_s_per_it"] for r in runs if r["side"] == s) for s in ("frozen", "live")}
print(f"ratio={total['frozen'] / total['live']:.3f}  (collect_s per iteration, frozen / live, over {args.pairs} pairs)")
