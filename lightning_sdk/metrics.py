"""Where a run's numbers go: metrics.jsonl, the trackers named in `run.report_to`, and a reward-curve PNG.

metrics.jsonl always gets every row: one per iteration, plus one per eval pass (`"phase": "eval"`, `"eval":
"untrained" | "trained"`, its mean `eval/reward_mean`, standard error `eval/stderr`, `eval/tasks`, and
`eval/split`: "train" when the eval tasks are the training tasks, "held-out" when none is, "mixed"; see
evals.py). Each tracker (TensorBoard by default; MLflow, W&B, Trackio with the `[track]` extra; accelerate's
tracker classes) gets the same numbers under the same names (metric_names: `rollout/reward_mean`, `train/loss`,
`time/update_s`, grouped by their "/" as trackers group tags) at the iteration's step, and the eval score as
`eval/reward_mean` (and `eval/stderr`) at step 0 (untrained) and step `run.iterations` (trained); and the run's
settings as its hyperparameters, one per dotted key (`train.lr`, as in lightning.toml).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from lightning_sdk import metric_names as names
from lightning_sdk.agent import MAX_ABS_REWARD
from lightning_sdk.config import OUTCOME_FILE, RUN_CONFIG_FILE, flatten
from lightning_sdk.errors import SetupError
from lightning_sdk.evals import EvalScore
from lightning_sdk.files import atomic_write_text


class Tracker(Protocol):
    """An experiment tracker: scalars by step (accelerate's trackers are ones)."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


def params(config: dict[str, Any]) -> dict[str, Any]:
    """The run's settings as trackers take hyperparameters: one per dotted key (`train.lr`, as in lightning.toml
    and the dashboard), so runs can be filtered and compared by each; lists and unset values as text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in flatten(config).items()}


def tensorboard(run_dir: Path, name: str, config: dict[str, Any]) -> Tracker:
    """TensorBoard in <run.dir>/tensorboard/, the settings as its hparams; the tags group by their "/"."""
    from accelerate.tracking import TensorBoardTracker

    tracker = TensorBoardTracker("tensorboard", run_dir)
    tracker.start()
    tracker.store_init_configuration(params(config))
    return tracker


def mlflow(run_dir: Path, name: str, config: dict[str, Any]) -> Tracker:
    """An MLflow run (experiment = run.name) at MLFLOW_TRACKING_URI, else in a SQLite store in the run directory
    (`sqlite:///<run.dir>/mlflow.db`, MLflow's supported local store; it refuses its file store by default)."""
    import logging

    import mlflow as mlflow_lib
    from accelerate.tracking import MLflowTracker

    # MLflow logs each database migration and experiment creation at INFO: not the run's output.
    for logger in ("mlflow", "alembic"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow_lib.set_tracking_uri(f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    tracker = MLflowTracker(experiment_name=name, run_name=name,
                            logging_dir=(run_dir / "mlflow-artifacts").resolve().as_uri())  # a new experiment's
    tracker.start()
    tracker.store_init_configuration(params(config))
    return tracker


def wandb(run_dir: Path, name: str, config: dict[str, Any]) -> Tracker:
    """A W&B run in WANDB_PROJECT (default lightning-sdk); WANDB_MODE=offline keeps it in <run.dir>/wandb/."""
    from accelerate.tracking import WandBTracker

    # The settings go with init: a run of its own (reinit) is not the global one its store_init_configuration sets.
    tracker = WandBTracker(os.environ.get("WANDB_PROJECT", "lightning-sdk"), name=name, dir=str(run_dir),
                           reinit="create_new", config=params(config))
    tracker.start()
    return tracker


def trackio(run_dir: Path, name: str, config: dict[str, Any]) -> Tracker:
    """A Trackio run in TRACKIO_PROJECT (default lightning-sdk)."""
    from accelerate.tracking import TrackioTracker

    tracker = TrackioTracker(os.environ.get("TRACKIO_PROJECT", "lightning-sdk"), name=name, config=params(config))
    tracker.start()
    return tracker


# run.report_to names -> (tracker, the module it needs, the pip requirement that brings it)
TRACKERS: dict[str, tuple[Callable[[Path, str, dict[str, Any]], Tracker], str, str]] = {
    "tensorboard": (tensorboard, "tensorboard", "tensorboard"),
    "mlflow": (mlflow, "mlflow", "lightning-agent-rl[track]"),
    "wandb": (wandb, "wandb", "lightning-agent-rl[track]"),
    "trackio": (trackio, "trackio", "lightning-agent-rl[track]"),
}


def check_trackers(names: list[str]) -> None:
    """Before anything is written: every tracker in run.report_to can be imported."""
    for name in names:
        _, module, requirement = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise SetupError(f"run.report_to includes {name!r} but {module} is not installed; "
                             f"pip install '{requirement}'")


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """A row's numbers, named as metrics.jsonl names them (one name everywhere: `train/loss` in every tracker)."""
    return {k: float(v) for k, v in row.items()
            if k not in names.LABELS and isinstance(v, (int, float)) and not isinstance(v, bool)}


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
        """An eval pass's score: a metrics.jsonl row, and its numbers (`eval/reward_mean`, `eval/stderr`,
        `eval/tasks`) at `step` in every tracker."""
        row = eval_row(label, score, step, policy=policy)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        values = _scalars(row)
        for tracker in self.trackers():
            tracker.log(values, step)

    def trackers(self) -> list[Tracker]:
        if self._trackers is None:
            self._trackers = [TRACKERS[name][0](self.run_dir, self._name, self._config) for name in self._report_to]
        return self._trackers

    def close(self) -> None:
        for tracker in self._trackers or []:
            tracker.finish()

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

        its = [row[names.ITERATION] for row in history]  # numbered from 1, as everywhere
        means = [row[names.REWARD_MEAN] if shown(row[names.REWARD_MEAN]) else math.nan for row in history]
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
    row: dict[str, Any] = {"phase": "eval", "eval": label, names.ITERATION: step, names.EVAL_REWARD_MEAN: score.mean,
                           names.EVAL_STDERR: score.stderr, names.EVAL_TASKS: score.n, names.EVAL_SPLIT: score.split}
    if score.failed is not None:  # how many failed and why (failures.summary): the dashboard's runs list reads it
        row[names.EVAL_FAILED] = score.failed
        if score.failed:
            row[names.EVAL_FAILURES] = score.failures
    if policy is not None:
        row["policy"] = policy
    return row
