"""A disk that fills during a checkpoint save: one line saying what to free and how to resume, the last checkpoint
and the store intact, and `--resume` continuing once space is freed.

The real fault: a 64 KiB tmpfs mounted over the run's checkpoints/ in a private mount namespace (`unshare -m`,
gone with the process; needs root, as CI's container has), so the kernel itself answers ENOSPC to safetensors and
torch. Where that cannot be done, the same error is injected at the trainer's public `save_state`."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdk.errors import RunError
from lightning_sdk.train.checkpoint import RunState, write_checkpoint

ROOT = Path(__file__).parent.parent


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k none /mnt && umount /mnt"],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs a private mount namespace (root) for a tiny tmpfs")
def test_a_full_disk_during_a_checkpoint_says_what_to_free_and_resume_continues(tmp_path):
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(rows[:4]) + "\n")
    (tmp_path / "agent.py").write_text((ROOT / "cookbook/arith/agent.py").read_text())
    (tmp_path / "lightning.toml").write_text(
        '[run]\nname = "full"\ndir = "run"\niterations = 1\n[agent]\nmodule = "agent.py"\n'
        '[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 2\ngroup_size = 2\n[model]\nname = "builtin:tiny-arith"\n')
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}
    run = f"{sys.executable} -m lightning_sdk.cli run --resume"
    script = (f"mount -t tmpfs -o size=64k none run/checkpoints && {run} > full.log 2>&1; echo $? > full.rc; "
              f"umount run/checkpoints; {run} > resumed.log 2>&1; echo $? > resumed.rc")
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=tmp_path, env=env, timeout=600, check=True)
    full = (tmp_path / "full.log").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1", full
    [line] = [x for x in full.splitlines() if "no space left" in x]
    assert line.startswith("run stopped: no space left on the disk of") and "lightning run --resume" in line, full
    assert ": free " in line and "Traceback" not in full and "SafetensorError" not in full, full
    print(line)
    resumed = (tmp_path / "resumed.log").read_text()
    assert (tmp_path / "resumed.rc").read_text().strip() == "0", resumed
    assert (tmp_path / "run/checkpoints/iter-00001/state.json").is_file()


class _FullDisk:
    """A trainer whose save (safetensors, in Rust) meets a full disk after writing part of the checkpoint."""

    def __init__(self, error: Exception):
        self.error = error

    def save_state(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
        raise self.error


@pytest.mark.parametrize("error", [
    "safetensors", OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded")])
def test_a_full_disk_at_the_trainer_s_save_is_one_line_and_leaves_the_last_checkpoint(tmp_path, error):
    from safetensors import SafetensorError

    if error == "safetensors":
        error = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                                'space left on device" })')
    done = write_checkpoint(tmp_path, 1, _Saves(), RunState(completed=1))
    with pytest.raises(RunError) as e:
        write_checkpoint(tmp_path, 2, _FullDisk(error), RunState(completed=2))
    message = str(e.value)
    assert "\n" not in message and "free at least" in message and "lightning run --resume" in message, message
    assert "iter-00001" in message and "MiB" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [done.name]  # nothing half-written left


class _Saves:
    def save_state(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "adapter_model.safetensors").write_bytes(b"\1" * 200_000)
