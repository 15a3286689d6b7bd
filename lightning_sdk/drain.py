"""A writer thread for items handed over from threads that must not wait: `put` only appends to a deque (no lock,
no wake-up), the thread takes what has gathered every `interval` seconds and hands it to `write` in batches, and
`flush` waits until everything put so far is written.

Waking the thread for every item would cost the putting thread (an agent's, the gateway's event loop) the GIL each
time: the writer would take it at once and keep it while it wrote.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


class Drain(Generic[T]):
    def __init__(self, write: Callable[[Sequence[T]], None], *, name: str, max_batch: int = 512,
                 interval: float = 0.05):
        """`write` gets each batch on the thread; what it raises is kept in `errors` (the thread goes on)."""
        self._write, self._max_batch, self._interval = write, max_batch, interval
        self._items: collections.deque[T] = collections.deque()
        self._wake = threading.Event()
        self._cond = threading.Condition()  # guards _busy; notified after every batch
        self._busy = False  # the thread holds items taken off the deque but not yet written
        self._stopping = False
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        self._items.append(item)  # deque.append is atomic: safe from any thread

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every item put so far is written; False if that took longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.set()
                self._cond.wait(min(left, self._interval))
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        self.flush()
        with self._cond:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    def _take(self) -> list[T]:
        with self._cond:
            batch = [self._items.popleft() for _ in range(min(len(self._items), self._max_batch))]
            self._busy = bool(batch)
        return batch

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            while batch := self._take():
                try:
                    self._write(batch)
                except Exception as e:  # keep the writer alive; its owner reports these loudly
                    self.errors.append(f"{type(e).__name__}: {e}")
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            with self._cond:
                self._cond.notify_all()
                if self._stopping:
                    return
