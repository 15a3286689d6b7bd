"""The pictures in docs/dashboard/, taken by Chromium over real runs: a folder of two runs (the second with another
train.lr), as `lightning run` left them.

    lightning run -c arith.toml && lightning run -c try.toml     # runs/arith, runs/try (see docs/dashboard.md)
    python scripts/dashboard_screenshots.py runs --a arith --b try --out docs/dashboard

Takes runs.png, run.png, rollouts.png (sorted by reward, searched), rollout.png (a training rollout whose group's
rewards differ: its advantage explained) and compare.png. Needs playwright and Debian's chromium.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlencode

from playwright.sync_api import Page, sync_playwright

from lightning_sdk.store import Store

CHROMIUM = "/usr/bin/chromium"


def explained_rollout(run_dir: Path) -> str:
    """A succeeded training rollout of the last iteration whose group has rewards that differ."""
    with Store(run_dir / "store.sqlite", read_only=True) as store:
        train = [r for r in store.rollouts(phase="train") if r.status == "succeeded"]
        last = max(r.iteration for r in train)
        groups: dict[str, list] = {}
        for r in train:
            if r.iteration == last:
                groups.setdefault(r.group_id, []).append(r)
        members = next(m for m in groups.values() if len({r.reward for r in m}) > 1)
        return max(members, key=lambda r: r.reward).rollout_id


def shoot(page: Page, base: str, where: str, wait: str, out: Path, *, full: bool = True, scroll: str = "") -> None:
    page.goto(base + where)
    page.wait_for_selector(wait)
    page.wait_for_timeout(300)  # the second poll's redraw, if any
    if scroll:
        page.locator(scroll).evaluate("e => e.scrollIntoView()")
    page.screenshot(path=str(out), full_page=full)
    print(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="the folder of runs")
    ap.add_argument("--a", required=True, help="the run to show (and the first of the two compared)")
    ap.add_argument("--b", required=True, help="the run it is compared with")
    ap.add_argument("--search", default="+ 4", help="the text searched for in rollouts.png")
    ap.add_argument("--out", type=Path, default=Path("docs/dashboard"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dash = subprocess.Popen([sys.executable, "-m", "lightning_sdk.cli", "dashboard", "--run-dir", str(args.root),
                             "--port", "0"], env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = dash.stdout.readline().split(" at ", 1)[1].split()[0]
        base = url.split("/?", 1)[0]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.goto(url)  # the key becomes a cookie
            shoot(page, base, "/#/", "#compare", args.out / "runs.png", full=False)
            shoot(page, base, f"/#/run/{args.a}", ".chart", args.out / "run.png")
            q = urlencode({"sort": "reward", "q": args.search})
            shoot(page, base, f"/#/run/{args.a}?{q}", "tr.click", args.out / "rollouts.png", full=False,
                  scroll="h3:text-is('Rollouts')")
            rid = explained_rollout(args.root / args.a)
            shoot(page, base, f"/#/run/{args.a}/rollout/{rid}", ".advantage", args.out / "rollout.png")
            shoot(page, base, f"/#/compare/{args.a}/{args.b}", ".config-diff tbody tr", args.out / "compare.png")
            browser.close()
    finally:
        dash.terminate()
        dash.wait(30)


if __name__ == "__main__":
    main()
