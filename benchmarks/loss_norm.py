"""train.loss_norm 'rollout' vs 'token' vs 'constant' on the arith run and the calc and sql cookbook examples.

    python benchmarks/loss_norm.py                       # all 27 runs (3 examples x 3 norms x seeds 0 1 2)
    python benchmarks/loss_norm.py --examples sql calc   # a subset; --table prints the table of runs already done

Each run is a full `lightning run` of the example's own lightning.toml with only run.seed and train.loss_norm changed
('constant' also sets train.max_completion_length to the agent's max_tokens, Dr.GRPO's L). One run at a time; each
finished run is appended to benchmarks/results/loss_norm.jsonl (a run already there is not repeated), then the
markdown table: per example and norm, the held-out eval before and after training over seeds (mean ± sample std),
the mean gain, the mean wall time of the whole run (both evals included) and the load averages seen; then each
norm against rollout, paired by example and seed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cookbook_run import RunResult, append, read, run_example

RESULTS = Path(__file__).resolve().parent / "results" / "loss_norm.jsonl"
# Dr.GRPO's constant L: the longest completion each example's agent asks for (its max_tokens).
MAX_TOKENS = {"arith": 8, "calc": 48, "sql": 64}
NORMS = ("rollout", "token", "constant")
LOGS = Path(tempfile.gettempdir()) / "loss_norm_logs"  # each run's output, for reading a surprise


def changes(example: str, norm: str) -> dict:
    train: dict[str, object] = {"loss_norm": norm}
    if norm == "constant":
        train["max_completion_length"] = MAX_TOKENS[example]
    return {"train": train}


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def table(results: list[RunResult]) -> str:
    lines = ["| example | loss_norm | seeds | eval before | eval after (mean ± std) | gain | wall s (mean) | load 1-min "
             "(start..end) |", "|---|---|---|---|---|---|---|---|"]
    for example in MAX_TOKENS:
        for norm in NORMS:
            rs = sorted((r for r in results if r.example == example and r.label == norm and r.rc == 0),
                        key=lambda r: r.seed)
            if not rs:
                continue
            loads = [float(r.load_before.split()[0]) for r in rs] + [float(r.load_after.split()[0]) for r in rs]
            lines.append(f"| {example} | {norm} | {','.join(str(r.seed) for r in rs)} | "
                         f"{mean_std([r.eval_before for r in rs])} | {mean_std([r.eval_after for r in rs])} | "
                         f"{statistics.mean(r.eval_after - r.eval_before for r in rs):+.3f} | "
                         f"{statistics.mean(r.wall_s for r in rs):.0f} | {min(loads):.1f}..{max(loads):.1f} |")
    failed = [r for r in results if r.rc != 0]
    if failed:
        lines.append("\nfailed: " + ", ".join(f"{r.example}/{r.label}/seed {r.seed} (exit {r.rc})" for r in failed))
    return "\n".join(lines)


def paired(results: list[RunResult]) -> str:
    """Each norm's eval after training minus rollout's at the same example and seed (the same untrained model, the
    same seeded eval), as mean ± standard error over the pairs: the comparison the seeds allow."""
    after = {(r.example, r.label, r.seed): r.eval_after for r in results if r.rc == 0}
    lines = []
    for norm in NORMS[1:]:
        d = [v - after[(ex, "rollout", seed)] for (ex, label, seed), v in after.items()
             if label == norm and (ex, "rollout", seed) in after]
        if len(d) > 1:
            lines.append(f"{norm} - rollout, eval after, paired by example and seed: {statistics.mean(d):+.3f} ± "
                         f"{statistics.stdev(d) / len(d) ** 0.5:.3f} (mean ± standard error over {len(d)} pairs)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", nargs="+", default=list(MAX_TOKENS), choices=list(MAX_TOKENS))
    ap.add_argument("--norms", nargs="+", default=list(NORMS), choices=list(NORMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--table", action="store_true", help="print the table of the runs already done, run nothing")
    args = ap.parse_args()
    if not args.table:
        RESULTS.parent.mkdir(exist_ok=True)
        LOGS.mkdir(exist_ok=True)
        for example in args.examples:
            for seed in args.seeds:  # seeds outermost: a cut-short session still has every norm at its first seeds
                for norm in args.norms:
                    if any(r.example == example and r.label == norm and r.seed == seed for r in read(RESULTS)):
                        continue
                    r = run_example(example, norm, seed, changes(example, norm), log_dir=LOGS)
                    append(RESULTS, r)
                    print(f"{example} {norm} seed {seed}: eval {r.eval_before:.3f} -> {r.eval_after:.3f}, "
                          f"{r.wall_s:.0f} s, load {r.load_before} .. {r.load_after}, exit {r.rc}", flush=True)
    print(table(read(RESULTS)))
    print(paired(read(RESULTS)))


if __name__ == "__main__":
    main()
