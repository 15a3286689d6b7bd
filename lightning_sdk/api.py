"""The Python API: `lightning_sdk.run(...)`, what `lightning run` does, from a script or a notebook.

(Not `train`: `lightning_sdk.train` is the trainer's package, lightning_sdk/train/.)

    import lightning_sdk as ls
    result = ls.run("lightning.toml", iterations=2, run_dir="runs/try", **{"train.lr": 1e-3})
    result.eval_trained, result.history[-1]["rollout/reward_mean"], result.adapter, result.adapters

A notebook (Jupyter, IPython) runs its cells inside an event loop, and the embedded collector owns an
asyncio.Runner, which refuses to start inside a running loop ("Runner.run() cannot be called from a running event
loop"). So when a loop is running in this thread the whole run goes to a worker thread, and this call waits for it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sdk import config as config_mod
from lightning_sdk.config import Config
from lightning_sdk.distribution import missing_train_extra
from lightning_sdk.errors import SetupError
from lightning_sdk.train.checkpoint import RunState, adapter_dir, latest_checkpoint, policy_adapters

__all__ = ["RunResult", "run"]

# Keyword shortcuts: the `lightning run` flags of the same name.
ALIASES = {"iterations": "run.iterations", "run_dir": "run.dir"}


@dataclass(frozen=True)
class RunResult:
    """What a finished run left: its directory, its checkpointed state, and the eval scores (None: no data.eval)."""

    run_dir: Path
    state: RunState
    eval_untrained: float | None
    eval_trained: float | None
    name: str = "run"  # run.name: the single policy's name
    eval_untrained_stderr: float | None = None  # each eval score's standard error (evals.EvalScore)
    eval_trained_stderr: float | None = None

    def __repr__(self) -> str:  # a line, not the whole history: what a notebook shows after `ls.run(...)`
        def score(x: float | None, stderr: float | None) -> str:
            return "None" if x is None else f"{x:.3f}" + ("" if stderr is None else f"±{stderr:.3f}")

        return (f"RunResult(run_dir={str(self.run_dir)!r}, iterations={self.state.completed}, "
                f"eval_untrained={score(self.eval_untrained, self.eval_untrained_stderr)}, "
                f"eval_trained={score(self.eval_trained, self.eval_trained_stderr)})")

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per iteration, as in metrics.jsonl (iteration numbers from 1)."""
        return self.state.history

    @property
    def adapter(self) -> Path | None:
        """The PEFT adapter of the last checkpoint (checkpoints/iter-0000N/trainer/adapter); None with [policies]:
        see `adapters`."""
        checkpoint = latest_checkpoint(self.run_dir)
        return adapter_dir(checkpoint) if checkpoint is not None and not policy_adapters(checkpoint) else None

    @property
    def adapters(self) -> dict[str, Path]:
        """Each policy's PEFT adapter in the last checkpoint, by policy name (trainer/adapters/<policy>/; a run
        without [policies]: its one adapter, under the run's name)."""
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is None:
            return {}
        return policy_adapters(checkpoint) or {self.name: adapter_dir(checkpoint)}


def run(config: str | Path | Config = "lightning.toml", *, resume: bool = False, overwrite: bool = False,
        quiet: bool = False, **overrides: Any) -> RunResult:
    """Train as `lightning run` does and return the run's state.

    `config` is a lightning.toml path (or a `Config`). `overrides` set config keys for this run: `iterations=` and
    `run_dir=` like the command's flags, any key by its dotted name through a dict (`**{"train.lr": 1e-3}`);
    relative paths are taken from the current directory, as the flags' are. `quiet` prints nothing (the run's
    files and the returned result hold it all). Bad input raises (ConfigError,
    DatasetError, ModelLoadError, SetupError) before anything is written; a run that stops raises RunError.
    Works inside a running event loop (a notebook) too: see the module docstring.
    """
    cfg = config if isinstance(config, Config) else config_mod.load(config)
    cfg = config_mod.override(cfg, {ALIASES.get(k, k): v for k, v in overrides.items()})
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(cfg, resume=resume, overwrite=overwrite, quiet=quiet)
    with ThreadPoolExecutor(1, thread_name_prefix="lightning-train") as pool:
        return pool.submit(_run, cfg, resume=resume, overwrite=overwrite, quiet=quiet).result()


def _run(cfg: Config, *, resume: bool, overwrite: bool, quiet: bool) -> RunResult:
    from lightning_sdk.console import configure_output, make_console

    try:
        from lightning_sdk.runtime import Runtime
    except ImportError as e:
        line = missing_train_extra(e, "lightning_sdk.run")
        if line is None:
            raise
        raise SetupError(line) from None

    configure_output()
    runtime = Runtime(cfg, resume=resume, overwrite=overwrite, console=make_console(quiet=quiet))
    state = runtime.run()
    final = runtime.final_score
    return RunResult(run_dir=Path(cfg.run.dir), state=state, eval_untrained=state.baseline_eval,
                     eval_trained=runtime.final_eval, name=cfg.run.name,
                     eval_untrained_stderr=state.baseline_eval_stderr,
                     eval_trained_stderr=final.stderr if final is not None else None)
