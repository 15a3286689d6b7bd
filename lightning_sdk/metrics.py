"""Where a run's numbers go: metrics.jsonl, the trackers named in `run.report_to`, and a reward-curve PNG.

metrics.jsonl always gets every row: one per iteration, plus one per eval pass (`"phase": "eval"`, `"eval":
"untrained" | "trained"`, its mean `eval.reward_mean`, standard error `eval_stderr`, `eval_tasks`, and
`eval_split`: "train" when the eval tasks are the training tasks, "held-out" when none is, "mixed"; see
evals.py). Each tracker (TensorBoard by default; MLflow, W&B, Trackio with the `[track]` extra) gets the same
numbers as scalars: `reward_mean`, `train/loss`, ... at the iteration's step, and the eval score as
`eval/reward_mean` (and `eval/reward_stderr`) at step 0 (untrained) and step `run.iterations` (trained).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from lightning_sdk.agent import MAX_ABS_REWARD
from lightning_sdk.config import OUTCOME_FILE, RUN_CONFIG_FILE
from lightning_sdk.errors import SetupError
from lightning_sdk.evals import EvalScore
from lightning_sdk.files import atomic_write_text


class Tracker(Protocol):
    """An experiment tracker: scalars by step."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MLflowTracker:
    """An MLflow run; with no MLFLOW_TRACKING_URI set, in a file store under the run directory (mlruns/).

    The file store needs no database or server (mlflow-skinny has no SQLAlchemy); MLflow 3 keeps it in maintenance
    mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is set, so it is set for this default only.
    """

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        import mlflow

        self._mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(name)
        self._run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics(values, step=step, run_id=self._run.info.run_id)

    def close(self) -> None:
        self._mlflow.end_run()


class WandbTracker:
    """A W&B run (WANDB_MODE=offline keeps it on disk, under the run directory's wandb/)."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lightning-sdk"), name=name,
                               dir=str(run_dir), config=config, reinit="create_new")

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        import trackio

        self._run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "lightning-sdk"), name=name,
                                 config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


# run.report_to names -> (tracker, the module it needs, the pip requirement that brings it)
TRACKERS: dict[str, tuple[Callable[[Path, str, dict[str, Any]], Tracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "tensorboard"),
    "mlflow": (MLflowTracker, "mlflow", "lightning-agent-rl[track]"),
    "wandb": (WandbTracker, "wandb", "lightning-agent-rl[track]"),
    "trackio": (TrackioTracker, "trackio", "lightning-agent-rl[track]"),
}


def check_trackers(names: list[str]) -> None:
    """Before anything is written: every tracker in run.report_to can be imported."""
    for name in names:
        _, module, requirement = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise SetupError(f"run.report_to includes {name!r} but {module} is not installed; "
                             f"pip install '{requirement}'")


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k.replace(".", "/"): float(v) for k, v in row.items()
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLog:
    def __init__(self, run_dir: Path, *, report_to: list[str] | None = None, name: str = "run",
                 config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self._report_to = ["tensorboard"] if report_to is None else list(report_to)
        self._name, self._config = name, config or {}
        self._trackers: list[Tracker] | None = None  # started on the first row: a run that fails first has none

    def write_config(self, config: dict[str, Any]) -> None:
        """The run's effective config as config.json, whole or not at all (the dashboard reads it while a run goes).
        Called once the run directory is this run's (fresh, resumed or overwritten), so it never replaces another's."""
        atomic_write_text(self.run_dir / RUN_CONFIG_FILE, json.dumps(config, indent=1, sort_keys=True) + "\n")

    def write_outcome(self, status: str, reason: str | None = None) -> None:
        """outcome.json: whether the run is running (this process), finished, stopped or interrupted, and why; the
        dashboard reads it (a run killed outright stays "running" with a process id that no longer exists)."""
        row = {"status": status, "reason": reason, "pid": os.getpid(), "time": time.time()}
        atomic_write_text(self.run_dir / OUTCOME_FILE, json.dumps(row) + "\n")

    def rewrite(self, history: list[dict[str, Any]], *, baseline_eval: EvalScore | None = None) -> None:
        """Make metrics.jsonl hold exactly the checkpointed iterations (after a resume nothing is doubled)."""
        rows = ([eval_row("untrained", baseline_eval, 0)] if baseline_eval is not None else []) + history
        atomic_write_text(self.jsonl, "".join(json.dumps(row) + "\n" for row in rows))

    def log(self, row: dict[str, Any]) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        values = _scalars(row)
        for tracker in self.trackers():
            tracker.log(values, int(row["iteration"]))

    def log_eval(self, label: str, score: EvalScore, step: int, *, policy: str | None = None) -> None:
        """An eval pass's score: a metrics.jsonl row, and `eval/reward_mean` (and its standard error) at `step` in
        every tracker."""
        row = eval_row(label, score, step, policy=policy)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        values = {"eval/reward_mean": score.mean}
        if score.stderr is not None:
            values["eval/reward_stderr"] = score.stderr
        for tracker in self.trackers():
            tracker.log(values, step)

    def trackers(self) -> list[Tracker]:
        if self._trackers is None:
            self._trackers = [TRACKERS[name][0](self.run_dir, self._name, self._config) for name in self._report_to]
        return self._trackers

    def close(self) -> None:
        for tracker in self._trackers or []:
            tracker.close()

    def plot(self, history: list[dict[str, Any]], *, baseline: float | None, final: float | None,
             eval_words: str = "eval") -> Path:
        """reward_curve.png: the training reward per iteration, the eval scores as lines (`eval_words` says what
        they score, e.g. "score on the training tasks")."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # A value no reward can reach (non-finite, beyond the reward bound) is left out of the picture: matplotlib
        # cannot lay out an axis up to ~1e308, and the numbers stay in metrics.jsonl.
        def shown(v: float | None) -> bool:
            return v is not None and math.isfinite(v) and abs(v) <= MAX_ABS_REWARD

        its = [row["iteration"] for row in history]  # numbered from 1, as everywhere
        means = [row["reward_mean"] if shown(row["reward_mean"]) else math.nan for row in history]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot(its, means, marker="o", label="training rollouts (mean reward)")
        if shown(baseline):
            ax.axhline(baseline, color="grey", linestyle="--", label=f"{eval_words}, untrained: {baseline:.3f}")
        if shown(final):
            ax.axhline(final, color="green", linestyle=":", label=f"{eval_words}, trained: {final:.3f}")
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


def eval_row(label: str, score: EvalScore, step: int, *, policy: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"phase": "eval", "eval": label, "iteration": step, "eval.reward_mean": score.mean,
                           "eval_stderr": score.stderr, "eval_tasks": score.n, "eval_split": score.split}
    if policy is not None:
        row["policy"] = policy
    return row
