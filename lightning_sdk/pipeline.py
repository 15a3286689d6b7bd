"""Pipelined training (train.max_staleness = k >= 1): the updates run in order on one thread of their own while
the next batches are collected, and a call sampled by an adapter too many updates behind is left out.

Batch n (iterations count from 1) is trained by update n, which starts from adapter version n - 1 (version v: the
adapter saved by update v; the base model is version 0). A call that adapter version v served is n - 1 - v
updates stale when batch n trains. Collection of batch n starts once update n - 1 - k has finished, so the server
holds version n - 1 - k or newer from then on; `split_stale` still checks every call, since the bound is only as
good as the record of which adapter served it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from queue import SimpleQueue

from lightning_sdk.transitions import Transition

__all__ = ["Staleness", "UpdateThread", "split_stale"]


@dataclass(frozen=True)
class Staleness:
    """The staleness of a batch's kept calls, in updates, and how many calls were left out for it."""

    mean: float
    max: int
    dropped: int

    def metrics(self) -> dict[str, float]:
        """As the trainer's own numbers (a run's row logs them as train/staleness_mean, ...)."""
        return {"staleness_mean": self.mean, "staleness_max": float(self.max), "stale_dropped": float(self.dropped)}


def split_stale(transitions: Sequence[Transition], versions: dict[str, int], trained: int,
                max_staleness: int) -> tuple[list[Transition], Staleness]:
    """The transitions batch `trained + 1` may train on, and their staleness. `versions`: served adapter name ->
    its version; a call of a name it does not hold (none recorded) counts as the oldest possible, version 0."""
    kept, ages, dropped = [], [], 0
    for t in transitions:
        age = trained - versions.get(t.policy or "", 0)
        if age > max_staleness:
            dropped += 1
        else:
            kept.append(t)
            ages.append(age)
    return kept, Staleness(sum(ages) / len(ages) if ages else 0.0, max(ages, default=0), dropped)


_STOP = object()


class UpdateThread:
    """Updates, run one at a time in the order given, on one daemon thread; `done(n)` waits for update n and
    raises the error of any update that failed (the trainer's own exception, so the run ends with its message)."""

    def __init__(self, first: int):
        self._finished = first  # updates up to this one are done (those of the checkpoint resumed from)
        self._cond = threading.Condition()
        self._queue: SimpleQueue = SimpleQueue()
        self._error: BaseException | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._loop, name="lightning-update", daemon=True)
        self._thread.start()

    def submit(self, n: int, update: Callable[[], None]) -> None:
        self.raise_error()
        self._queue.put((n, update))

    def done(self, n: int) -> None:
        """Wait until update n has finished (at once for n at or below the first)."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished >= n or self._error is not None)
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self, *, cancel: bool) -> None:
        """Let the running update finish (its checkpoint written), then stop; `cancel` drops the queued ones
        (their batches are collected again on --resume), else they run first."""
        self._cancelled = cancel
        self._queue.put(_STOP)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP or self._cancelled or self._error is not None:
                return
            n, update = item
            try:
                update()
            except BaseException as e:  # handed to the collecting side, which stops the run with it
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._finished = n
                self._cond.notify_all()
