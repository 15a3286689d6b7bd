"""What a person reads: the run's console and the log set-up, shared by the command line and `ls.run`."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from contextlib import nullcontext
from typing import Any


from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.segment import Segments

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
    """Output that is not a terminal (a log file, nohup, CI, a notebook) gets no transformers / hub progress bars:
    there each redraw is a line of noise, and a notebook without ipywidgets warns (TqdmWarning) at each one. The
    environment variable reaches server subprocesses and libraries imported later; the libraries' own switches the
    ones a notebook's earlier cells already imported (they read the variable once, at import)."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


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


def live_shown(console: Console) -> bool:
    """Whether a spinner or progress bar (rich's Live) can show on `console`: a terminal, or a notebook with
    ipywidgets (without it rich warns 'install "ipywidgets"' at each one). In a log or a pipe it shows nothing, and
    only leaves a blank line behind."""
    if console.is_jupyter:
        return importlib.util.find_spec("ipywidgets") is not None
    return console.is_terminal


def status(console: Console, text: str) -> Any:
    """`console.status(text)` where it can show (live_shown); nothing elsewhere."""
    return console.status(text) if live_shown(console) else nullcontext()


def print_whole(console: Console, renderable: RenderableType) -> None:
    """Print a table uncut: on a terminal at its width, elsewhere (a log, a pipe, a notebook) as wide as the table
    needs, so no cell (a long policy name) is cut short."""
    if console.is_terminal and not console.is_jupyter:
        console.print(renderable)
        return
    options = console.options.update(width=10_000)
    width = max(Measurement.get(console, options, renderable).maximum, console.width)
    # rendered at its own width, then printed as is (soft_wrap: the console neither wraps nor crops it)
    console.print(Segments(console.render(renderable, options.update(width=width))), soft_wrap=True)

