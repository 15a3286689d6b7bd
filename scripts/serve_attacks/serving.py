"""A real `lightning serve` for the serve red team's figures, from whichever checkout is on PYTHONPATH: a project on
the built-in tiny model in a temporary folder, the CLI started as a child (so the same figure runs against any
version of the project), its app URL and key, and its log. Loopback only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

AGENT = '''
import lightning_sdk as ls
from openai import OpenAI

@ls.rollout
def solve(task, llm):
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    out = client.chat.completions.create(model=llm.model, max_tokens=2,
                                         messages=[{"role": "user", "content": task["question"]}])
    return out.choices[0].message.content or ""

@ls.reward
def score(task, output):
    return 1.0 if task["answer"] in output else 0.0
'''

KEY = "app-key"


@dataclass
class Served:
    proc: subprocess.Popen
    url: str  # the app's base URL ends in /v1
    key: str
    directory: Path  # the serve directory: serve.sqlite, server.log
    log: Path  # everything the CLI printed (stdout and stderr)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def write_project(folder: Path, toml_extra: str = "") -> Path:
    (folder / "agent.py").write_text(AGENT)
    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(3)]
    for name in ("train.jsonl", "eval.jsonl"):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    toml = ('[run]\nname = "app"\n[agent]\nmodule = "agent.py"\n[data]\ntrain = "train.jsonl"\neval = "eval.jsonl"\n'
            '[model]\nname = "builtin:tiny-arith"\ndtype = "float32"\n[serve]\nmax_batch_size = 4\n'
            '[train]\nlora_r = 4\nlr = 0.01\n' + toml_extra)
    (folder / "lightning.toml").write_text(toml)
    return folder / "lightning.toml"


@contextmanager
def serve(toml_extra: str = "", *flags: str, start_s: float = 300):
    """`lightning serve` on a fresh project (`toml_extra` appended to lightning.toml, e.g. a [learn] table)."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        project = write_project(folder, toml_extra)
        directory = folder / "serve"
        log = folder / "cli.log"
        env = {**os.environ, "COLUMNS": "400", "LIGHTNING_SERVE_KEY": KEY}
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "serve", "-c", str(project), "--dir",
                                     str(directory), *flags], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=folder)
        try:
            deadline = time.monotonic() + start_s
            while True:
                text = log.read_text(errors="replace")
                line = next((x for x in text.splitlines() if x.startswith("serving ")), None)
                if line is not None:
                    url = line.split(" at ", 1)[1].split()[0]
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("lightning serve did not start: " + text[-2000:])
                time.sleep(0.2)
            yield Served(proc, url, KEY, directory, log)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def emit(item: int, what: str, value) -> None:
    """One figure: the runner (scripts/serve_attack_figures.py) reads these lines from stdout."""
    print(json.dumps({"item": item, "what": what, "value": str(value)}), flush=True)
