"""Issue 52 item 10: a run whose gateway process is stopped (SIGSTOP) says so, naming it, rather than failing its
rollouts one timeout at a time as if the agent were slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

AGENT = '''
import os, signal, threading
import psutil
from openai import OpenAI
import lightning_sdk as ls

once = threading.Lock()

@ls.rollout
def solve(task, llm):
    if once.acquire(blocking=False):
        for p in psutil.Process().children():
            if "lightning_sdk.gateway.isolated" in " ".join(p.cmdline()):
                os.kill(p.pid, signal.SIGSTOP)
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=30)
    client.chat.completions.create(model=llm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    return "done"

@ls.reward
def score(task, output):
    return 1.0
'''


def test_a_stopped_gateway_process_is_named_not_blamed_on_rollout_timeouts(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    (tmp_path / "lightning.toml").write_text(
        '[run]\nname = "one"\ndir = "run"\niterations = 1\n[agent]\nmodule = "agent.py"\n'
        '[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 1\ngroup_size = 2\n'
        '[model]\ndtype = "float32"\n[rollout]\nconcurrency = 2\ntimeout = 5.0\n[train]\nlora_r = 4\n')
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "run", "-c", "lightning.toml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd(), "COLUMNS": "400"})
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "the gateway's process (pid" in text and "is stopped (SIGSTOP or SIGTSTP)" in text, text[-3000:]
