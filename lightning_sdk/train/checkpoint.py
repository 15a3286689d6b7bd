"""A run's checkpoints: what each holds, where it lives, and how one appears only complete.

    run.dir/checkpoints/iter-00003/
        state.json              RunState: iterations done, their metrics, the eval scores, the policy's name
        trainer/                GRPOTrainer.save_state: adapter/, optimizer, RNG, step counter
            adapter/            the PEFT adapter (what the server hot-loads and `lightning eval` scores)
            adapters/NAME/      instead, with [policies]: one PEFT adapter per policy
"""

from __future__ import annotations

import errno
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_sdk.errors import RunError
from lightning_sdk.files import atomic_dir

CHECKPOINTS = "checkpoints"
STATE = "state.json"
TRAINER = "trainer"
ADAPTER = "adapter"  # inside TRAINER: GRPOTrainer.save_state puts the PEFT adapter there
ADAPTERS = "adapters"  # inside TRAINER, with [policies]: one PEFT adapter directory per policy


@dataclass
class RunState:
    """What a checkpoint remembers besides the weights: finished iterations and their metrics."""

    completed: int = 0  # iterations finished and checkpointed
    history: list[dict[str, Any]] = field(default_factory=list)
    baseline_eval: float | None = None
    baseline_eval_stderr: float | None = None  # its standard error (evals.EvalScore)
    adapter_name: str | None = None
    adapter_names: dict[str, str] | None = None  # with [policies]: each policy's served adapter name

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def read(cls, checkpoint: Path) -> "RunState":
        return cls(**json.loads((checkpoint / STATE).read_text()))


def checkpoint_name(iteration: int) -> str:
    return f"iter-{iteration:05d}"


def trained_into(phase: str, iteration: int, status: str, completed: int) -> str | None:
    """The checkpoint whose update trained on a rollout, given the run's completed iterations; None if none did.

    Update N trains on the succeeded train rollouts of iteration N and is checkpointed as iter-N (the name stays
    though only the newest checkpoints are kept). A rollout of an iteration whose update never completed is not
    trained on: resume marks it 'untrained' (Store.mark_untrained). Failed rollouts trained at
    rollout.failed_reward are not named here.
    """
    if phase == "train" and status == "succeeded" and 1 <= iteration <= completed:
        return checkpoint_name(iteration)
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    # A checkpoint directory only ever appears by an atomic rename of a complete one.
    done = sorted((Path(run_dir) / CHECKPOINTS).glob("iter-*"))
    return done[-1] if done else None


def completed_iterations(run_dir: Path) -> int:
    """Iterations whose update completed, as the latest checkpoint records them (0 without one, or unreadable)."""
    checkpoint = latest_checkpoint(run_dir)
    try:
        return int(json.loads((checkpoint / STATE).read_text())["completed"]) if checkpoint is not None else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def checkpoint_of(path: Path) -> Path | None:
    """The checkpoint `path` is, or lies in (its trainer/adapter, ...); None if it is in none."""
    for p in (Path(path), *Path(path).parents):
        if p.name.startswith("iter-") and (p / STATE).is_file():
            return p
    return None


def checkpoint_iteration(checkpoint: Path) -> int | None:
    """The iteration whose update made `checkpoint` (its state.json's `completed`); None if unreadable."""
    try:
        return int(json.loads((checkpoint / STATE).read_text())["completed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def adapter_dir(checkpoint: Path) -> Path:
    """The checkpoint's PEFT adapter (what `PeftModel.from_pretrained` and the server's hot-load take)."""
    return checkpoint / TRAINER / ADAPTER


def policy_adapters(checkpoint: Path) -> dict[str, Path]:
    """Each policy's PEFT adapter in a checkpoint of a run with [policies] (empty for a single-policy one)."""
    root = checkpoint / TRAINER / ADAPTERS
    return {d.name: d for d in sorted(root.iterdir()) if d.is_dir()} if root.is_dir() else {}


def write_checkpoint(run_dir: Path, iteration: int, trainer: Any, state: RunState, keep: int = 3) -> Path:
    """Checkpoint `trainer` and `state` as iter-<iteration>; only the newest `keep` checkpoints stay."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / checkpoint_name(iteration)
    try:
        with atomic_dir(final) as tmp:
            trainer.save_state(tmp / TRAINER)
            (tmp / STATE).write_text(state.to_json())
    except Exception as e:
        if not disk_full(e):
            raise
        last = latest_checkpoint(run_dir)
        kept = f"the last checkpoint, {last.name}, and the store are intact" if last else "the store is intact"
        need = f"at least {_size(last)} (a checkpoint's size)" if last else "room for a checkpoint (the adapter and " \
                                                                          "its optimizer state)"
        raise RunError(f"no space left on the disk of {root} while saving checkpoint {final.name} (nothing of it was "
                       f"kept; {kept}): free {need} on that disk, then continue with `lightning run --resume`") \
            from None
    for old in sorted(root.glob("iter-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def disk_full(e: BaseException) -> bool:
    """Whether `e` says the disk (or the user's quota) is full: an OSError, or a library's own error that only says
    so in words (safetensors' SafetensorError: "No space left on device (os error 28)")."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return any(words in str(e) for words in ("No space left on device", "Disk quota exceeded", "StorageFull"))


def _size(checkpoint: Path) -> str:
    """A checkpoint's size on disk, in words."""
    total = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    return f"{total / 2**20:.1f} MiB" if total < 2**30 else f"{total / 2**30:.2f} GiB"
