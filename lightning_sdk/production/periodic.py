"""A background thread that runs one pass every few seconds until stopped: `lightning serve`'s learning schedule
and its retention pass. A pass that raises is logged and counted, and the next one runs as planned: a fault of
the background work never stops serving."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("lightning_sdk")


class Periodic:
    def __init__(self, run_once: Callable[[], object], every_s: float, *, name: str, on_failure: str):
        """`on_failure`: the log line of a pass that raised (its traceback follows)."""
        self.run_once, self.every_s, self.on_failure = run_once, every_s, on_failure
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """After the pass in progress, if any."""
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - logged and counted; serving goes on
                self.failures += 1
                log.exception(self.on_failure)
