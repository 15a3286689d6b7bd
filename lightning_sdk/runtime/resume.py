"""Where a run starts from: a fresh run.dir (its lock taken, or replaced with --overwrite), or the last complete
checkpoint of a killed run (--resume), with what the killed process left half done set straight."""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console

from lightning_sdk.config import Config, Policy
from lightning_sdk.errors import SetupError
from lightning_sdk.files import DirBusyError, clean_atomic_leftovers, locked_dir
from lightning_sdk.store import Store
from lightning_sdk.train.checkpoint import CHECKPOINTS, TRAINER, RunState, latest_checkpoint

RUN_LOCK = ".lock"  # in run.dir: held (flock) by the one `lightning run` using it


def take_run_dir(stack: ExitStack, d: Path, *, resume: bool, overwrite: bool, console: Console) -> Path | None:
    """Check run.dir, take its lock (held in `stack` for the whole run), and return the checkpoint to resume."""
    existing = d.exists() and any(p.name != RUN_LOCK for p in d.iterdir())
    if existing and not resume and not overwrite:
        raise SetupError(f"run.dir {d} already holds a run; pass --resume to continue it, --overwrite to "
                         f"replace it, or --run-dir for a new one")
    try:  # before anything is deleted or written: two runs on one directory would collect the same iteration
        stack.enter_context(locked_dir(d, RUN_LOCK))
    except DirBusyError as e:
        raise SetupError(f"run.dir {e}: another `lightning run` is using it; wait for it to end, or use "
                         f"--run-dir for a new run") from None
    if existing and overwrite:
        for p in d.iterdir():  # all but the lock we hold
            if p.name != RUN_LOCK:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        return None
    if not resume:
        return None
    cleaned = clean_atomic_leftovers(d / CHECKPOINTS)
    if cleaned:
        console.print(f"removed {cleaned} unfinished checkpoint write(s) of a killed run from {d / CHECKPOINTS}")
    return latest_checkpoint(d)


def refuse_conflict(checkpoint: Path | None, cfg: Config, policies: list[Policy] | None) -> None:
    """A checkpoint whose trainer settings the config changed in a way that cannot resume: a SetupError, raised
    before the store or the metrics are touched."""
    if checkpoint is None:
        return
    from lightning_sdk.train.trainer import checkpoint_conflict

    conflict = checkpoint_conflict(checkpoint / TRAINER, cfg.train, policies)
    if conflict:
        raise SetupError(conflict)


def reopen(store: Store, state: RunState, console: Console) -> None:
    """The killed process's leftovers in the store: rollouts it left running are abandoned, and those collected
    after its last complete update are untrained (that iteration is collected again)."""
    abandoned = store.abandon_running()
    if abandoned:
        console.print(f"[yellow]{abandoned} rollout(s) left running by the previous process marked abandoned")
    untrained = store.mark_untrained(state.completed)
    if untrained:
        console.print(f"[yellow]{untrained} rollout(s) collected after iteration {state.completed}, whose update "
                      f"never completed, marked untrained; that iteration is collected again")
