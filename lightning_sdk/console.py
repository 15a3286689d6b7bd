"""What a person reads: the run's console and the log set-up, shared by the command line and `ls.run`."""

from __future__ import annotations

import logging
import os
import sys

from rich.console import Console

LOG_WIDTH = 200  # columns when the output is not a terminal: the iteration table's 11 columns fit uncut


def configure_output() -> None:
    """`lightning` and `lightning_sdk.train`: our own log lines (the model-build status) at INFO; libraries (httpx
    logs every request at INFO) only when they warn. basicConfig leaves an application's own logging alone."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("lightning_sdk").setLevel(logging.INFO)
    quiet_progress_bars()


def quiet_progress_bars() -> None:
    """Output that is not a terminal (a log file, nohup, CI) gets no transformers / hub progress bars: there each
    redraw is a line of noise. Set before huggingface_hub is imported; server subprocesses inherit it."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def make_console() -> Console:
    """The run's console. Not a terminal and no COLUMNS: rich would fall back to 80 columns and cut every value of
    the summary table ('ari…'); a log file has no width to respect, so lines may be as long as the table needs."""
    console = Console(emoji=False)  # what it prints quotes tasks and errors: ":x:" in them stays ":x:"
    if not console.is_terminal and not console.is_jupyter and "COLUMNS" not in os.environ:
        console = Console(width=LOG_WIDTH, emoji=False)
    return console
