"""Plot the reward curves of several runs on one chart, from each run's metrics.jsonl.

    python scripts/compare_runs.py runs/embedded runs/remote --label embedded --label "remote, 2 workers" \
        --out docs/remote/reward_curves.png

Each run: its training reward per iteration (a line), and its eval before and after training (markers at
iteration 0 and at its last iteration), so runs of different runtimes can be compared at a glance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lightning_sdk import metric_names as names  # noqa: E402


def read(run_dir: Path) -> tuple[list[dict], dict[str, tuple[int, float]]]:
    rows, evals = [], {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = names.current_row(json.loads(line))
        if row.get("phase") == "eval":
            evals[row["eval"]] = (row["iteration"], row[names.EVAL_REWARD_MEAN])
        else:
            rows.append(row)
    return rows, evals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (each with a metrics.jsonl)")
    p.add_argument("--label", action="append", default=[], help="one per run, in order (default: its folder)")
    p.add_argument("--title", default="reward per iteration")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    labels = args.label + [r.name for r in args.runs[len(args.label):]]
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=120)
    for run, label, color in zip(args.runs, labels, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rows, evals = read(run)
        ax.plot([r["iteration"] for r in rows], [r[names.REWARD_MEAN] for r in rows], color=color, marker=".",
                label=f"{label}: training rollouts")
        for name, marker in (("untrained", "v"), ("trained", "^")):
            if name in evals:
                it, score = evals[name]
                ax.plot([it], [score], color=color, marker=marker, markersize=9, linestyle="none",
                        label=f"{label}: eval {name} {score:.2f}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
