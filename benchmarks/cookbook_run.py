"""One `lightning run` of a cookbook example with some keys changed, measured: eval before/after, wall time, peak memory.

Used by benchmarks/loss_norm.py, benchmarks/policies_sql.py and benchmarks/pipeline.py. The changed config is written next to the example's
own lightning.toml (relative paths in it resolve against the file's folder) and removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_sdk import metric_names as names

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RunResult:
    example: str
    label: str
    seed: int
    eval_before: float
    eval_after: float
    wall_s: float
    peak_rss_mib: float  # the largest sum of RSS over the run's process tree (lightning run + its server), sampled
    load_before: str  # /proc/loadavg's three averages when the run started and when it ended
    load_after: str
    rc: int


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(data: dict) -> str:
    """Tables of scalars and one level of sub-tables ([policies.NAME]): all a lightning.toml holds."""
    lines: list[str] = []
    for table, body in data.items():
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict)}
        if scalars:
            lines.append(f"[{table}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in scalars.items()]
        for sub, sub_body in body.items():
            if isinstance(sub, str) and isinstance(sub_body, dict):
                lines.append(f"[{table}.{sub}]")
                lines += [f"{k} = {toml_value(v)}" for k, v in sub_body.items()]
    return "\n".join(lines) + "\n"


def merged(base: dict, changes: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for table, body in changes.items():
        out.setdefault(table, {}).update(body)
    return out


def load_avg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def tree_rss_kib(pid: int) -> int:
    """Resident memory of `pid` and all its descendants, from /proc (psutil is not a dependency)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def metrics_rows(metrics: Path) -> list[dict]:
    return [names.current_row(json.loads(line)) for line in metrics.read_text().splitlines() if line.strip()]


def evals(rows: list[dict]) -> tuple[float, float]:
    by = {r["eval"]: r[names.EVAL_REWARD_MEAN] for r in rows if r.get("phase") == "eval"}
    return by.get("untrained", float("nan")), by.get("trained", float("nan"))


def run_example(example: str, label: str, seed: int, changes: dict, *, config: str = "lightning.toml",
                log_dir: Path | None = None, inspect: Callable[[list[dict]], None] | None = None,
                env: dict[str, str] | None = None) -> RunResult:
    """`lightning run` in cookbook/<example> (or the repo root for 'arith') with `changes` merged into its config
    and `env` into its environment. `inspect` gets the run's metrics.jsonl rows (a run that succeeded) before its
    directory is removed."""
    folder = ROOT if example == "arith" else ROOT / "cookbook" / example
    base = tomllib.loads((folder / config).read_text())
    cfg = merged(base, {**changes, "run": {**changes.get("run", {}), "seed": seed}})
    fd, cfg_path = tempfile.mkstemp(prefix=".bench-", suffix=".toml", dir=folder)
    os.close(fd)
    Path(cfg_path).write_text(dump_toml(cfg))
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{example}-"))
    log = open(log_dir / f"{example}-{label}-s{seed}.log", "w") if log_dir else subprocess.DEVNULL
    load0, t0 = load_avg(), time.perf_counter()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "run", "-c", cfg_path, "--run-dir",
                                 str(run_dir / "run")], cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        peak = [0]

        def sample() -> None:  # twice a second: the server child lives only while the run does
            while proc.poll() is None:
                peak[0] = max(peak[0], tree_rss_kib(proc.pid))
                time.sleep(0.5)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        sampler.join()
        wall = time.perf_counter() - t0
    finally:
        os.unlink(cfg_path)
    rows = metrics_rows(run_dir / "run" / "metrics.jsonl") if rc == 0 else []
    before, after = evals(rows)  # nan, nan for a failed run: it has no rows
    if inspect is not None and rc == 0:
        inspect(rows)
    shutil.rmtree(run_dir, ignore_errors=True)  # store.sqlite and checkpoints: tens of MB a run
    return RunResult(example, label, seed, before, after, wall, peak[0] / 1024, load0, load_avg(), rc)


def append(path: Path, result: RunResult) -> None:
    with path.open("a") as f:
        f.write(json.dumps(asdict(result)) + "\n")


def read(path: Path) -> list[RunResult]:
    if not path.exists():
        return []
    return [RunResult(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
