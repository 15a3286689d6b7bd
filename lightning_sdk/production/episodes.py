"""Episodes of a deployed app: every trace id a call carries (its `traceparent`, the rollout's baggage entry, or
the per-episode URL `/rollouts/{trace id}/v1`) is an episode, open from its first call on.

In a run the runtime opens each rollout before its agent runs; a deployed app has no runtime in front of it, so
the trace id alone names the episode. Calls with no trace id are recorded as calls of no episode; feedback can
still name them by call or response id.
"""

from __future__ import annotations

import re

from lightning_sdk.gateway.capture import OpenRollouts, Rollout

PHASE = "serve"  # the phase of a served episode's calls
_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def episode_id(trace_id: str) -> str:
    """The rollout id an episode's calls are stored under."""
    return f"ep-{trace_id}"


class TraceEpisodes(OpenRollouts):
    """OpenRollouts where any well-formed trace id (32 lowercase hex digits, not all zero) is an open episode."""

    def get(self, key: str | None) -> Rollout | None:
        found = super().get(key)
        if found is not None or not key or not _TRACE_ID.fullmatch(key) or key == "0" * 32:
            return found
        self.open(key, episode_id(key), phase=PHASE)
        return super().get(key)
