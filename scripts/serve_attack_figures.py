"""Before/after figures for `lightning serve` under attack (issue 52): each file in scripts/serve_attacks/ (but
serving.py) attacks a real `lightning serve` and prints one JSON line per figure; this runs each twice, once with an
older checkout of the project on PYTHONPATH and once with this one, and prints a row per figure:

    python scripts/serve_attack_figures.py --before ../before                 # every figure
    python scripts/serve_attack_figures.py --before ../before --only canary   # one file's
    python scripts/serve_attack_figures.py --before ../before --before learner_cost=../older

`--before NAME=DIR` gives one file its own older checkout (an item fixed earlier than the others). Loopback only;
each file bounds its own waits, and this bounds each run (--timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ATTACKS = HERE / "serve_attacks"
ROOT = HERE.parent


def figures(script: Path, checkout: Path, timeout: float) -> tuple[dict[tuple[int, str], str], float]:
    """The figures `script` prints with `checkout`'s lightning_sdk, and how long it took."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=checkout)
        out, err = done.stdout, done.stderr if done.returncode else ""
    except subprocess.TimeoutExpired as e:
        out, err = (e.stdout or b"").decode(errors="replace"), f"no end in {timeout:g} s"
    rows = {}
    for line in out.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[(int(row["item"]), row["what"])] = row["value"]
    if err:
        rows[(0, f"{script.stem}: the figures' own failure")] = err.strip().splitlines()[-1][:200]
    return rows, time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", action="append", required=True,
                   help="the older checkout (DIR), or NAME=DIR for one file of serve_attacks/")
    p.add_argument("--only", default="", help="comma-separated file names (without .py) of serve_attacks/")
    p.add_argument("--timeout", type=float, default=900, help="seconds for one file's run")
    args = p.parse_args()
    default, own = None, {}
    for b in args.before:
        name, _, path = b.rpartition("=")
        if name:
            own[name] = Path(path).resolve()
        else:
            default = Path(path).resolve()
    scripts = sorted(s for s in ATTACKS.glob("*.py") if s.stem != "serving")
    if args.only:
        wanted = set(args.only.split(","))
        scripts = [s for s in scripts if s.stem in wanted]
    print("| item | figure | before | after |\n| --- | --- | --- | --- |", flush=True)
    for script in scripts:
        older = own.get(script.stem, default)
        if older is None:
            sys.exit(f"--before: no older checkout for {script.stem} (give DIR or {script.stem}=DIR)")
        before, t0 = figures(script, older, args.timeout)
        after, t1 = figures(script, ROOT, args.timeout)
        for key in [*after, *(k for k in before if k not in after)]:  # in the order the file measured them
            cells = (str(key[0]), key[1], before.get(key, "-"), after.get(key, "-"))
            print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |", flush=True)
        print(f"<!-- {script.stem}: before {older} ({t0:.0f} s), after {ROOT} ({t1:.0f} s) -->", flush=True)


if __name__ == "__main__":
    main()
