"""Which episodes a canary adapter serves: sha256(trace id) mapped to [0, 1) below the share, so the choice is the
same for every call of an episode and across restarts (production.canary decides the canary's fate)."""

from __future__ import annotations

import hashlib


def routes_to_canary(trace_id: str, share: float) -> bool:
    h = int.from_bytes(hashlib.sha256(trace_id.encode()).digest()[:8], "big")
    return h / 2**64 < share
