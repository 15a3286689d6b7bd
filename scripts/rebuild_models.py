"""Rebuild the tiny models shipped beside the cookbook's teachers (cookbook/<example>/prebuilt/).

A fresh checkout then starts with no minutes of building: `lightning_sdk.models` uses a teacher's shipped model
while its name (which holds the recipe's key: the teacher file's hash, its data's hash, the builder's VERSION)
is the one the current recipe makes, and builds into the cache otherwise. tests/test_prebuilt_models.py fails
while a shipped model is stale.

    python scripts/rebuild_models.py            # rebuild the stale ones, remove what they replace; then commit
    python scripts/rebuild_models.py --check    # list the stale ones, exit 1 if any
    python scripts/rebuild_models.py --force cookbook/calc/teacher.py   # rebuild this one even if current
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's lightning_sdk, installed or not

from lightning_sdk import models  # noqa: E402
from lightning_sdk.files import atomic_dir  # noqa: E402
from lightning_sdk.models import tiny  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("teachers", nargs="*", type=Path, help="teacher files (default: cookbook/*/teacher.py)")
    p.add_argument("--check", action="store_true", help="only list stale models; exit 1 if any")
    p.add_argument("--force", action="store_true", help="rebuild even the current ones")
    args = p.parse_args()
    stale = 0
    for path in [t.resolve() for t in args.teachers] or sorted(ROOT.glob("cookbook/*/teacher.py")):
        recipe = models.tiny_recipe(path)
        target = recipe.prebuilt / tiny.model_name(recipe.teacher)
        current = (target / "config.json").exists()
        others = [d for d in recipe.prebuilt.glob("tiny-*") if d != target]
        if current and not others and not args.force:
            print(f"{target.relative_to(ROOT)}: current")
            continue
        stale += 1
        if args.check:
            print(f"{target.relative_to(ROOT)}: {'stale siblings' if current else 'missing'}")
            continue
        if not current or args.force:
            start = time.monotonic()
            with atomic_dir(target) as tmp:
                tiny.build(tmp, recipe.teacher, steps=recipe.steps, batch=recipe.batch)
            for f in target.rglob("*"):  # atomic_dir's private temporary folder: make the shipped files readable
                f.chmod(0o644)
            target.chmod(0o755)
            print(f"{target.relative_to(ROOT)}: built in {time.monotonic() - start:.0f}s")
        for old in others:
            shutil.rmtree(old)
            print(f"{old.relative_to(ROOT)}: removed")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
