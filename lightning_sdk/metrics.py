"""Where a run's numbers go: metrics.jsonl, TensorBoard scalars, and a reward-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_sdk.files import atomic_write_text


class MetricsLog:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self._tb = None

    def rewrite(self, history: list[dict[str, Any]]) -> None:
        """Make metrics.jsonl hold exactly the checkpointed iterations (after a resume nothing is doubled)."""
        atomic_write_text(self.jsonl, "".join(json.dumps(row) + "\n" for row in history))

    def log(self, row: dict[str, Any]) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        tb = self._writer()
        step = int(row["iteration"])
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                tb.add_scalar(key.replace(".", "/"), value, step)
        tb.flush()

    def _writer(self):
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        return self._tb

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()

    def plot(self, history: list[dict[str, Any]], *, baseline: float | None, final: float | None) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        its = [row["iteration"] for row in history]  # numbered from 1, as everywhere
        means = [row["reward_mean"] for row in history]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot(its, means, marker="o", label="training rollouts (mean reward)")
        if baseline is not None:
            ax.axhline(baseline, color="grey", linestyle="--", label=f"eval, untrained: {baseline:.3f}")
        if final is not None:
            ax.axhline(final, color="green", linestyle=":", label=f"eval, trained: {final:.3f}")
        ax.set_xlabel("iteration")
        ax.set_ylabel("reward")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        out = self.run_dir / "reward_curve.png"
        fig.savefig(out)
        plt.close(fig)
        return out
