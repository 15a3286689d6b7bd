"""Which inference server (replica) takes a request: the one with the fewest requests in flight (ties: the least
recently picked). A replica that refuses connections is taken out of the rotation with one line, its request
sent to another, and tried again every RETRY_S seconds, so one that is restarted comes back by itself."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

log = logging.getLogger("lightning_sdk")  # the runtime's logger: a replica leaving the rotation is part of a run

RETRY_S = 5.0  # seconds a replica that refused a connection stays out before a request tries it again


class Backends:
    """In-flight counts per backend root URL; `pick` is the least-loaded replica in the rotation."""

    def __init__(self, urls: Sequence[str], *, retry_s: float = RETRY_S):
        if not urls:
            raise ValueError("a gateway needs at least one backend url")
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = [0] * len(self.urls)
        self.served = [0] * len(self.urls)
        self.out: dict[int, float] = {}  # replica -> when a request may try it again
        self.retry_s = retry_s
        self._last = [0] * len(self.urls)
        self._tick = itertools.count(1)

    def _in_rotation(self) -> list[int]:
        now = time.monotonic()
        return [k for k in range(len(self.urls)) if self.out.get(k, 0.0) <= now]

    def pick(self) -> int:
        ks = self._in_rotation() if self.out else range(len(self.urls))
        i = min(ks or range(len(self.urls)), key=lambda k: (self.in_flight[k], self._last[k], k))
        self.in_flight[i] += 1
        self.served[i] += 1
        self._last[i] = next(self._tick)
        return i

    def done(self, i: int) -> None:
        self.in_flight[i] -= 1

    def refused(self, i: int) -> bool:
        """Replica i refused a connection (nothing reached it): out of the rotation for a while. Whether another
        replica can take the request; with one replica there is none, as before."""
        self.served[i] -= 1
        if len(self.urls) == 1:
            return False
        if i not in self.out:
            log.warning("gateway: the inference server at %s refuses connections; taken out of the rotation "
                        "(tried again every %g s)", self.urls[i], self.retry_s)
        self.out[i] = time.monotonic() + self.retry_s
        return bool(self._in_rotation())

    def reached(self, i: int) -> None:
        """Replica i took a request: back in the rotation if it was out."""
        if self.out and self.out.pop(i, None) is not None:
            log.warning("gateway: the inference server at %s answers again; back in the rotation", self.urls[i])
