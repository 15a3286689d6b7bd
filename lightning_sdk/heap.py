"""The run's startup objects (imported libraries, the model's modules, the servers) kept out of Python's cyclic
garbage collector while the run goes on.

Each full collection walks every tracked object while holding the GIL, and every thread's allocations (the
gateway's, the agents', the trainer's) count towards the next one: with a run's startup heap that is a stall of
a good part of a second, at random moments, for in-process agents and the gateway alike (benchmarks/README.md,
"Collection throughput"). Frozen (`gc.freeze`, as vLLM's server does after its startup), those objects are
skipped; what is made later is collected as before. `gc.unfreeze` at the end hands them back, so a process that
runs several runs (a notebook) keeps nothing that became garbage meanwhile.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_heap() -> Iterator[int]:
    """Collect, then freeze every object tracked now until the block ends; yields how many were frozen. If objects
    are frozen already (the caller's own `gc.freeze`, an enclosing block), nothing is done: they stay as they
    are."""
    if gc.get_freeze_count():
        yield 0
        return
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
