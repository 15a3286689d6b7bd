"""cookbook/sql: writer and rewriter as two policies (two LoRA adapters) against one shared policy, seeds 0 1 2.

    python benchmarks/policies_sql.py            # runs what is not yet in benchmarks/results/policies_sql.jsonl
    python benchmarks/policies_sql.py --table    # prints the table of the runs already done

"shared" is cookbook/sql/lightning.toml (rollout.components = ["writer", "rewriter"]: one adapter), "two" is
cookbook/sql/two_policies.toml (the same run with [policies.writer] and [policies.rewriter]); each run changes only
run.seed. A shared-policy run already made by benchmarks/loss_norm.py (sql, loss_norm "rollout" = the default, same
seed) is the same configuration and is used instead of running it again: the table's `from` column says which.
Each row: held-out eval before and after (mean ± sample std over seeds), the mean gain, wall time of the whole
`lightning run` (both evals included), and peak memory: the largest sum of resident memory over the run's process
tree (the `lightning run` process and its inference-server child), sampled twice a second from /proc.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cookbook_run import RunResult, append, read, run_example

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "policies_sql.jsonl"
LOSS_NORM = HERE / "results" / "loss_norm.jsonl"
LOGS = Path(tempfile.gettempdir()) / "policies_sql_logs"
CONFIGS = {"shared": "lightning.toml", "two": "two_policies.toml"}


def runs(label: str) -> tuple[list[RunResult], str]:
    own = [r for r in read(RESULTS) if r.label == label and r.rc == 0]
    if own or label != "shared":
        return own, "policies_sql.py"
    return [r for r in read(LOSS_NORM) if r.example == "sql" and r.label == "rollout" and r.rc == 0], "loss_norm.py"


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def table() -> str:
    lines = ["| sql | config | seeds | eval before | eval after (mean ± std) | gain | wall s (mean) | peak RSS MiB "
             "(mean, max) | load 1-min (start..end) | from |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, cfg in CONFIGS.items():
        rs, source = runs(label)
        if not rs:
            continue
        loads = [float(x.split()[0]) for r in rs for x in (r.load_before, r.load_after)]
        lines.append(f"| {label} | {cfg} | {','.join(str(r.seed) for r in rs)} | "
                     f"{mean_std([r.eval_before for r in rs])} | {mean_std([r.eval_after for r in rs])} | "
                     f"{statistics.mean(r.eval_after - r.eval_before for r in rs):+.3f} | "
                     f"{statistics.mean(r.wall_s for r in rs):.0f} | {statistics.mean(r.peak_rss_mib for r in rs):.0f}, "
                     f"{max(r.peak_rss_mib for r in rs):.0f} | {min(loads):.1f}..{max(loads):.1f} | {source} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--table", action="store_true", help="print the table of the runs already done, run nothing")
    args = ap.parse_args()
    if not args.table:
        RESULTS.parent.mkdir(exist_ok=True)
        LOGS.mkdir(exist_ok=True)
        for seed in args.seeds:
            for label in args.configs:
                if any(r.seed == seed for r in runs(label)[0]):
                    continue
                r = run_example("sql", label, seed, {}, config=CONFIGS[label], log_dir=LOGS)
                append(RESULTS, r)
                print(f"sql {label} seed {seed}: eval {r.eval_before:.3f} -> {r.eval_after:.3f}, {r.wall_s:.0f} s, "
                      f"peak {r.peak_rss_mib:.0f} MiB, load {r.load_before} .. {r.load_after}, exit {r.rc}", flush=True)
    print(table())


if __name__ == "__main__":
    main()
