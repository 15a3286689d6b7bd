"""The gateway's door to its backend: while it is closed, new calls wait in the gateway (answered once it opens),
and `closed()` returns once no call is at the backend. `lightning serve` closes it while its vLLM sleeps for the
learner's update (one GPU shared in time): vLLM must have no request in flight when it sleeps (its /sleep aborts
them: pause mode "abort", vLLM 0.32's default), and none may reach it asleep. A waiting call holds no backend
resource, only its connection; the app sees a slower answer, never an error.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

POLL_S = 0.02  # how often `closed` looks whether the calls at the backend are done


class Door:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the loop thread's check-and-enter and a closer's close are one step each
        self._open = True
        self._waiting: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}  # set when the door opens, per loop
        self.inside = 0  # calls sent to the backend and not yet done
        self.waited = 0  # calls that found the door closed (since start)

    async def enter(self) -> None:
        """On the gateway's loop, before a call goes to the backend: wait while the door is closed (woken when it
        opens, not polling: a thousand waiting calls cost nothing meanwhile)."""
        counted = False
        while True:
            with self._lock:
                if self._open:
                    self.inside += 1
                    return
                if not counted:
                    self.waited, counted = self.waited + 1, True
                opened = self._waiting.setdefault(asyncio.get_running_loop(), asyncio.Event())
            await opened.wait()

    def leave(self) -> None:
        """The call is done at the backend (answered, failed, or its client went away)."""
        with self._lock:
            self.inside -= 1

    @contextmanager
    def closed(self, timeout: float) -> Iterator[None]:
        """From any thread: new calls wait; once the calls at the backend are done (TimeoutError after `timeout`
        seconds, the door open again), the body runs; then the door opens and the waiting calls go on."""
        with self._lock:
            self._open = False
        try:
            end = time.monotonic() + timeout
            while True:
                with self._lock:
                    if self.inside <= 0:
                        break
                    busy = self.inside
                if time.monotonic() >= end:
                    raise TimeoutError(f"{busy} call(s) still at the backend after {timeout:g} s")
                time.sleep(POLL_S)
            yield
        finally:
            with self._lock:
                self._open = True
                waiting, self._waiting = self._waiting, {}
            for loop, opened in waiting.items():
                try:
                    loop.call_soon_threadsafe(opened.set)
                except RuntimeError:  # that loop is closed: nobody waits on it any more
                    pass
