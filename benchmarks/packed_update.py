"""Packed calls (train.pack_calls, train/packing.py) vs one row per call: the update of the same batch.

    python benchmarks/packed_update.py --rounds 3                  # rag and sql: one short real run each first
    python benchmarks/packed_update.py --config /tmp/x/lightning.toml   # the train rollouts of a finished run
    python benchmarks/packed_update.py --model shape:qwen2.5-0.5b@8 --examples rag   # rag's calls, trained on a
                                                                                        # real family's shape

Records: each example's own lightning.toml, shrunk to one iteration (8 tasks x groups of 4, 1 eval task), run with
`lightning run` in a temporary directory; its train rollouts' transitions are the batch. Then, per example, rounds
alternate the two sides, each in a fresh subprocess: the example's trainer settings with pack_calls off or on, one
warm-up update, then one timed update of the same batch (`GRPOTrainer.step` seconds, and the process's CPU seconds in
it: on a shared machine the wall clock also counts waiting for a core), the tokens its forward passes read
(num_input_tokens, padding not counted) and the process's peak RSS growth over the updates (ru_maxrss minus the RSS before).
Each side also runs with the LM head over every position (`full head`: what a model the head check rejects takes,
train/head.py) against the head on the trained tokens only, in the same rounds.
`--model` trains the same records on another model (a `shape:` model: a real family's widths, heads and vocabulary,
models/shapes.py) in float32. Prints a table per example (median and spread over rounds), `head_ratio=` (full head /
trained tokens only, one row per call then packed, per example), `loss_gap=` and `grad_norm_gap=` (the largest
|packed - one row per call| over rounds: the same update), `cpu_ratio=` and `ratio=` (one row per call / packed, CPU
then wall seconds, head on trained tokens) last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def records(example: str, tmp: Path) -> Path:
    """A one-iteration run of the example (its own config, fewer tasks); the path of its lightning.toml."""
    src = ROOT / "cookbook" / example
    text = (src / "lightning.toml").read_text()
    for name, n in (("train", 8), ("test", 1)):
        lines = (src / f"data/{name}.jsonl").read_text().splitlines()[:n]
        (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    text = text.replace('module = "agent.py"', f'module = "{src / "agent.py"}"')
    text = text.replace('name = "tiny:teacher.py"', f'name = "tiny:{src / "teacher.py"}"')
    text = text.replace('"data/train.jsonl"', '"train.jsonl"').replace('"data/test.jsonl"', '"test.jsonl"')
    text = re.sub(r"iterations = \d+", "iterations = 1", text)
    text = re.sub(r"tasks_per_iteration = \d+", "tasks_per_iteration = 8", text)
    text = re.sub(r"group_size = \d+", "group_size = 4", text)
    (tmp / "lightning.toml").write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "run", "-c", "lightning.toml"], cwd=tmp, env=env,
                   check=True, capture_output=True, timeout=1800)
    return tmp / "lightning.toml"


def side(config: str, packed: bool, full_head: bool, model: str | None) -> dict:
    """In this (child) process: two updates of the run's batch with pack_calls = `packed`, the LM head over every
    position (`full_head`) or at the trained tokens only; on `model` (float32) instead of the run's."""
    import torch

    from lightning_sdk import config as cfgs, models, transitions
    from lightning_sdk.store import Store
    from lightning_sdk.train.trainer import GRPOTrainer

    torch.set_num_threads(1)
    cfg = cfgs.load(Path(config))
    store = Store(cfg.run.dir / "store.sqlite")
    ts = [t for r in store.rollouts(phase="train") if r.status == "succeeded"
          for t in transitions.to_transitions(r, store.spans(r.rollout_id), components=cfg.rollout.components,
                                              error_reward=cfg.rollout.error_reward)]
    train = cfg.train.model_copy(update={"pack_calls": packed, "device": "cpu"})
    tr = GRPOTrainer(models.resolve(model or cfg.model.name), train, seed=0,
                     dtype="float32" if model else cfg.model.dtype)
    if full_head:
        tr.head.full_head_reason = "benchmarked against the full head"
    rss0 = _rss_kib()
    tr.step(ts)  # warm-up: first-call costs, on both sides alike
    t0, c0 = time.perf_counter(), time.process_time()
    m = tr.step(ts)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "cpu": cpu, "read": m["num_input_tokens"], "tokens": m["num_tokens"], "calls": len(ts),
            "peak_mib": (peak - rss0) / 1024, "loss": m["loss"], "grad_norm": m["grad_norm"]}


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", action="append", help="lightning.toml of a finished run (repeatable)")
    ap.add_argument("--examples", nargs="+", default=["rag", "sql"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="train on this model instead of the example's (e.g. shape:qwen2.5-0.5b@8)")
    ap.add_argument("--side", nargs=3, help=argparse.SUPPRESS)  # child: CONFIG on|off trained|full
    a = ap.parse_args()
    if a.side:
        print(json.dumps(side(a.side[0], a.side[1] == "on", a.side[2] == "full", a.model)))
        return
    if a.model:
        from lightning_sdk import models

        models.resolve(a.model)  # built once, before the timed children
    configs = a.config or [str(records(ex, Path(tempfile.mkdtemp(prefix=f"packed-{ex}-")))) for ex in a.examples]
    ratios, cpu_ratios, head_ratios, gaps = [], [], [], {"loss": 0.0, "grad_norm": 0.0}
    names = ("today", "packed", "today, full head", "packed, full head")
    if a.model:  # a real vocabulary's head over every position of every row would not fit: trained tokens only
        names = names[:2]
    for config in configs:
        results: dict[str, list[dict]] = {name: [] for name in names}
        loads = []
        for k in range(a.rounds):
            for name in (names if k % 2 == 0 else names[::-1]):
                model = ["--model", a.model] if a.model else []
                out = subprocess.run([sys.executable, __file__, *model, "--side", config,
                                      "on" if name.startswith("packed") else "off",
                                      "full" if "full" in name else "trained"],
                                     check=True, capture_output=True, text=True, env={**os.environ,
                                                                                      "OMP_NUM_THREADS": "1"})
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                loads.append(Path("/proc/loadavg").read_text().split()[0])
        today, packed = results["today"], results["packed"]
        for key in gaps:
            gaps[key] = max(gaps[key], *(abs(p[key] - t[key]) for p, t in zip(packed, today)))
        ratio = statistics.median(r["seconds"] for r in today) / statistics.median(r["seconds"] for r in packed)
        ratios.append(ratio)
        for name in ("today", "packed") if not a.model else ():
            head_ratios.append(statistics.median(r["seconds"] for r in results[f"{name}, full head"])
                               / statistics.median(r["seconds"] for r in results[name]))
        print(f"\n{config}: {today[0]['calls']} calls, {today[0]['tokens']:.0f} completion tokens; load "
              f"{min(loads)}-{max(loads)}")
        print("| side | update s (median, min-max) | CPU s | tokens read | peak RSS growth MiB |")
        print("| --- | --- | --- | --- | --- |")
        for name, rs in results.items():
            print(f"| {name} | {spread([r['seconds'] for r in rs])} | {spread([r['cpu'] for r in rs])} | "
                  f"{rs[0]['read']:.0f} | {spread([r['peak_mib'] for r in rs])} |")
        cpu_ratios.append(statistics.median(r["cpu"] for r in today) / statistics.median(r["cpu"] for r in packed))
        print(f"speedup {ratio:.2f}x ({cpu_ratios[-1]:.2f}x in CPU seconds), tokens read "
              f"{packed[0]['read'] / today[0]['read']:.2f} of today's")
    print("head_ratio=" + " ".join(f"{r:.3f}" for r in head_ratios))
    print(f"loss_gap={gaps['loss']:.2e} grad_norm_gap={gaps['grad_norm']:.2e}")
    print("cpu_ratio=" + " ".join(f"{r:.3f}" for r in cpu_ratios))
    print("ratio=" + " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
