"""Pipelined training (train.max_staleness = 1) against the alternating loop (0), on cookbook examples.

    python benchmarks/pipeline.py                                   # calc and rag, seed 0, their 30 iterations
    python benchmarks/pipeline.py --seeds 0 1 2 --examples calc     # the learning comparison

Each run is a real `lightning run` of the example (its own lightning.toml, with run.seed and train.max_staleness
set; benchmarks/cookbook_run.py); the two modes alternate per seed. From each run's metrics.jsonl: the
iteration time (the loop's wall time over its iterations, the last row's elapsed_s), each side's busy fraction
(collection: the sum of collect_s; update: update_s + hotload_s, over the loop's wall time) and the eval score
before and after. The figure: `ratio=` pipelined iteration time / max(mean collect, mean update + hot-load) of
the alternating run of the same example and seed (1.0: the pipeline hides the shorter side completely).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from cookbook_run import run_example
from lightning_sdk import metric_names as names


def one_run(example: str, seed: int, staleness: int, iterations: int | None, logs: Path) -> dict:
    changes: dict = {"train": {"max_staleness": staleness}}
    if iterations is not None:
        changes["run"] = {"iterations": iterations}
    its: list[dict] = []
    r = run_example(example, f"k{staleness}", seed, changes, log_dir=logs,
                    inspect=lambda rows: its.extend(row for row in rows if row.get("phase") != "eval"))
    if r.rc != 0:
        sys.exit(f"{example} seed {seed} k={staleness} failed (exit {r.rc}); its log is in {logs}")
    wall = its[-1][names.timing("elapsed_s")]
    collect = sum(row[names.timing("collect_s")] for row in its)
    update = sum(row[names.timing("update_s")] + row[names.timing("hotload_s")] for row in its)
    return {"example": example, "seed": seed, "k": staleness, "iterations": len(its), "total_s": r.wall_s,
            "iteration_s": wall / len(its), "collect_s": collect / len(its), "update_s": update / len(its),
            "collect_busy": collect / wall, "update_busy": update / wall,
            "staleness_mean": statistics.mean(row.get("train/staleness_mean", 0.0) for row in its),
            "before": r.eval_before, "after": r.eval_after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", nargs="+", default=["calc", "rag"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--iterations", type=int, default=None, help="override the examples' run.iterations")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    results = []
    logs = Path(tempfile.mkdtemp(prefix="bench-pipeline-logs-"))  # each run's output, kept
    print(f"run logs: {logs}", flush=True)
    for example in args.examples:
        for i, seed in enumerate(args.seeds):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate which mode goes first
                r = one_run(example, seed, k, args.iterations, logs)
                r["load"] = os.getloadavg()[0]
                results.append(r)
                print(json.dumps(r), flush=True)
    print("\n| example | seed | k | iteration s | collect s | update + hot-load s | collect busy | update busy "
          "| staleness | eval before | eval after | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['example']} | {r['seed']} | {r['k']} | {r['iteration_s']:.2f} | {r['collect_s']:.2f} | "
              f"{r['update_s']:.2f} | {r['collect_busy']:.2f} | {r['update_busy']:.2f} | {r['staleness_mean']:.2f} "
              f"| {r['before']} | {r['after']} | {r['load']:.1f} |")
    print()
    for example in args.examples:
        ratios, gains = [], {0: [], 1: []}
        for seed in args.seeds:
            by_k = {r["k"]: r for r in results if r["example"] == example and r["seed"] == seed}
            alt, pipe = by_k[0], by_k[1]
            ratios.append(pipe["iteration_s"] / max(alt["collect_s"], alt["update_s"]))
            for k in (0, 1):
                if by_k[k]["after"] is not None:
                    gains[k].append(by_k[k]["after"])
        speedup = statistics.mean(r["iteration_s"] for r in results if r["example"] == example and r["k"] == 0) / \
            statistics.mean(r["iteration_s"] for r in results if r["example"] == example and r["k"] == 1)
        line = f"{example}: ratio={statistics.mean(ratios):.3f} (per seed {[round(x, 3) for x in ratios]}), " \
               f"speedup={speedup:.2f}x"
        if gains[0] and gains[1]:
            line += f", eval after k=0 {statistics.mean(gains[0]):.3f} vs k=1 {statistics.mean(gains[1]):.3f}"
        print(line)


if __name__ == "__main__":
    main()
