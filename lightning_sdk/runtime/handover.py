"""One GPU shared in time: the inference server gives its memory to the trainer for each update."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_sdk.servers import SleepableServer


@contextmanager
def gpu_handover(server: Any, timings: dict[str, float]) -> Iterator[None]:
    """Around the update phase: a server that can sleep (vLLM) frees its GPU memory for the trainer, then wakes.

    Records sleep_s and wake_s in `timings`; a server without sleep support (the CPU server) is left alone.
    """
    if not (isinstance(server, SleepableServer) and server.can_sleep):
        yield
        return
    t = time.perf_counter()
    server.sleep()
    timings["sleep_s"] = time.perf_counter() - t
    yield
    t = time.perf_counter()
    server.wake_up()
    timings["wake_s"] = time.perf_counter() - t
