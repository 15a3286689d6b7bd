"""Small projects the tests make on the builtin tiny model: a started `lightning serve` (in this process) and a
one-task `lightning run` of an agent through the CLI (a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_sdk import config
from lightning_sdk.production import deployment


def deploy(folder: Path, serve: str = "") -> deployment.Deployment:
    """`lightning serve` of the tiny model on 127.0.0.1 (`serve`: more [serve] keys, one per line); close() it."""
    (folder / "train.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    (folder / "lightning.toml").write_text('[data]\ntrain = "train.jsonl"\n[model]\nname = "builtin:tiny-arith"\n'
                                           '[agent]\nmodule = "app"\n[serve]\nmax_batch_size = 4\n' + serve)
    return deployment.start(config.load(folder / "lightning.toml"), folder / "serve", host="127.0.0.1", port=0,
                            api_key=None, retention_s=3600)


def run_one_task(folder: Path, agent: str, *, group_size: int, timeout: float) -> tuple[int, str]:
    """`lightning run` of `agent` (a module's source) for one iteration of one task: (exit code, all it printed)."""
    (folder / "agent.py").write_text(agent)
    (folder / "train.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    (folder / "lightning.toml").write_text(
        '[run]\nname = "one"\ndir = "run"\niterations = 1\n[agent]\nmodule = "agent.py"\n'
        f'[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 1\ngroup_size = {group_size}\n'
        f'[model]\ndtype = "float32"\n[rollout]\nconcurrency = {group_size}\ntimeout = {timeout}\n'
        '[train]\nlora_r = 4\n')
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "run", "-c", "lightning.toml"], cwd=folder,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd(), "COLUMNS": "400"})
    return out.returncode, out.stdout + out.stderr
