"""Pipelined training (train.max_staleness = 1) against the alternating loop (0), on cookbook examples.

    python benchmarks/pipeline.py                                   # calc and rag, seed 0, their 30 iterations
    python benchmarks/pipeline.py --seeds 0 1 2 --examples calc     # the learning comparison

Each run is a real `lightning run` of the example (its own lightning.toml, with run.seed and train.max_staleness
set) in a temporary copy of its folder; the two modes alternate per seed. From each run's metrics.jsonl: the
iteration time (the loop's wall time over its iterations, the last row's elapsed_s), each side's busy fraction
(collection: the sum of collect_s; update: update_s + hotload_s, over the loop's wall time) and the eval score
before and after. The figure: `ratio=` pipelined iteration time / max(mean collect, mean update + hot-load) of
the alternating run of the same example and seed (1.0: the pipeline hides the shorter side completely).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def configured(toml: str, seed: int, staleness: int, iterations: int | None) -> str:
    """The example's lightning.toml with run.seed, run.iterations and train.max_staleness set."""
    out, section = [], None
    for line in toml.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped.strip("[]")
        key = stripped.split("=", 1)[0].strip() if "=" in stripped and not stripped.startswith("#") else None
        if (section, key) in (("run", "seed"), ("train", "max_staleness")) or \
                (iterations is not None and (section, key) == ("run", "iterations")):
            continue
        out.append(line)
        if stripped == "[run]":
            out.append(f"seed = {seed}")
            if iterations is not None:
                out.append(f"iterations = {iterations}")
        if stripped == "[train]":
            out.append(f"max_staleness = {staleness}")
    return "\n".join(out) + "\n"


def one_run(example: str, seed: int, staleness: int, iterations: int | None, work: Path) -> dict:
    src = ROOT / "cookbook" / example
    d = work / f"{example}-s{seed}-k{staleness}"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    (d / "lightning.toml").write_text(configured((src / "lightning.toml").read_text(), seed, staleness, iterations))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "run", "--run-dir", str(d / "run")], cwd=d,
                          capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{example} seed {seed} k={staleness} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]
    its = [r for r in rows if r.get("phase") != "eval"]
    evals = {r["eval"]: r["eval.reward_mean"] for r in rows if r.get("phase") == "eval"}
    wall = its[-1]["elapsed_s"]
    collect = sum(r["collect_s"] for r in its)
    update = sum(r["update_s"] + r["hotload_s"] for r in its)
    shutil.rmtree(d)
    return {"example": example, "seed": seed, "k": staleness, "iterations": len(its), "total_s": total,
            "iteration_s": wall / len(its), "collect_s": collect / len(its), "update_s": update / len(its),
            "collect_busy": collect / wall, "update_busy": update / wall,
            "staleness_mean": statistics.mean(r.get("train.staleness_mean", 0.0) for r in its),
            "before": evals.get("untrained"), "after": evals.get("trained")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", nargs="+", default=["calc", "rag"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--iterations", type=int, default=None, help="override the examples' run.iterations")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        for example in args.examples:
            for i, seed in enumerate(args.seeds):
                for k in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate which mode goes first
                    r = one_run(example, seed, k, args.iterations, Path(tmp))
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
