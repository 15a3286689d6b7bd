"""What a person reads: the run's console and the log set-up, shared by the command line and `ls.run`."""

from __future__ import annotations

import logging
import os
import sys

from typing import Any

from rich.console import Console

LOG_WIDTH = 200  # columns when the output is not a terminal: the iteration table's 11 columns fit uncut


def configure_output() -> None:
    """`lightning` and `lightning_sdk.train`: our own log lines (the model-build status) at INFO; libraries (httpx
    logs every request at INFO) only when they warn. basicConfig leaves an application's own logging alone."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for stream in (sys.stdout, sys.stderr):  # a log file or pipe gets each line as it is printed, not in blocks
        if not stream.isatty() and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    logging.getLogger("lightning_sdk").setLevel(logging.INFO)
    quiet_progress_bars()
    drop_known_noise()


def quiet_progress_bars() -> None:
    """Output that is not a terminal (a log file, nohup, CI) gets no transformers / hub progress bars: there each
    redraw is a line of noise. Set before huggingface_hub is imported; server subprocesses inherit it."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


# bitsandbytes (installed with the dev and gpu extras) tries, when peft imports it on a CPU with AVX512-BF16, to
# fetch a faster 4-bit kernel from the Hub; `kernels` refuses it (unverified publisher, or no network) and
# bitsandbytes warns, then uses its own kernel. Nothing a user can act on: dropped by this exact message only.
NOISE = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}


def drop_known_noise() -> None:
    """Drop the library log lines of NOISE (this process: the runtime's, the model server's)."""
    for name, start in NOISE.items():
        logger = logging.getLogger(name)
        if not any(getattr(f, "noise", None) == start for f in logger.filters):
            logger.addFilter(_Drop(start))


class _Drop(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.noise = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.noise)


def make_console(quiet: bool = False) -> Console:
    """The run's console. Not a terminal and no COLUMNS: rich would fall back to 80 columns and cut every value of
    the summary table ('ari…'); a log file has no width to respect, so lines may be as long as the table needs."""
    console = Console(emoji=False, quiet=quiet)  # what it prints quotes tasks and errors: ":x:" stays ":x:"
    if not console.is_terminal and not console.is_jupyter and "COLUMNS" not in os.environ:
        console = Console(width=LOG_WIDTH, emoji=False, quiet=quiet)
    return console


def printable(value: Any, limit: int | None = 200) -> str:
    """`value` as one line of plain text for a log or a console: at most `limit` characters, and every control
    character (newline, ESC of an ANSI or OSC sequence, BEL...) escaped, so that text a client sent can neither
    forge a line nor drive the terminal."""
    text = str(value) if limit is None else str(value)[:limit]
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def printable_lines(text: str) -> str:
    """`text` for a console with its line breaks and tabs kept, every other control character escaped (`printable`)."""
    return "\n".join(printable(line.replace("\t", " " * 4), None) for line in text.split("\n"))
