"""Torch threads of the built-in server and the trainer on one machine's CPU, quiet and beside other busy processes.

    python benchmarks/cpu_threads.py                        # calc, 8 iterations, 0 and 3 busy processes
    python benchmarks/cpu_threads.py --example arith --busy 0 2

Each setting is one `lightning run` of the example (benchmarks/cookbook_run.run_example, evals included) with
run.iterations changed, and `--busy` processes spinning beside it (`while True: pass`, one core each):
- `every core`: OMP_NUM_THREADS = the machine's cores, so the server and the trainer each take every core, torch's
  default (the reference: what runs did before the server left a core to the agents);
- `default`: what a run does on its own (servers/select.cpu_threads: the server leaves one core to the agents and
  the gateway, the trainer keeps torch's default);
- `one`: OMP_NUM_THREADS = 1 in both (what the README suggests on a busy machine).
Printed per busy level and setting: the mean collect and update seconds per iteration (metrics.jsonl), the whole
run's wall time, and `ratio=<iteration time, default / every core>`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from cookbook_run import run_example
from lightning_sdk import metric_names as names
from lightning_sdk.servers.select import usable_cores

SPIN = "while True: pass"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--example", default="calc", choices=["arith", "calc", "sql", "rag"])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 3], help="busy processes beside the run")
    args = ap.parse_args()
    cores = usable_cores()
    settings = {"every core": {"OMP_NUM_THREADS": str(cores)}, "default": {}, "one": {"OMP_NUM_THREADS": "1"}}
    print(f"{args.example}, {args.iterations} iterations, {cores} cores")
    for busy in args.busy:
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
        try:
            per_iteration = {}
            for label, env in settings.items():
                rows: list[dict] = []
                r = run_example(args.example, label, 0, {"run": {"iterations": args.iterations}}, env=env,
                                inspect=rows.extend)
                train = [row for row in rows if row.get("phase") != "eval" and names.timing("collect_s") in row]
                if r.rc != 0 or not train:
                    print(f"busy {busy}, {label}: the run failed (exit {r.rc})")
                    continue
                collect = statistics.mean(row[names.timing("collect_s")] for row in train)
                update = statistics.mean(row[names.timing("update_s")] for row in train)
                per_iteration[label] = collect + update
                print(f"busy {busy}, {label:>10}: collect {collect:5.2f} s, update {update:5.2f} s per iteration; "
                      f"run {r.wall_s:5.1f} s; load {r.load_before} .. {r.load_after}", flush=True)
            if {"default", "every core"} <= per_iteration.keys():
                print(f"busy {busy}: ratio={per_iteration['default'] / per_iteration['every core']:.2f}  "
                      f"(iteration time, default / every core)")
        finally:
            for s in spinners:
                s.kill()
                s.wait()


if __name__ == "__main__":
    main()
