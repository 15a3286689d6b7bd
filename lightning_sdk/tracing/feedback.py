"""`ls.feedback(...)`: an app's reward for a served response, call or episode, sent to `lightning serve` whenever
it is known (minutes or days later). The server checks it against the recorded calls (production/ledger.py);
a refusal raises FeedbackRefused with the field it names. A retry of the same reward is recorded once."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import httpx


class FeedbackRefused(Exception):
    """The server refused the reward: `status` (HTTP), `field`, and its one line."""

    def __init__(self, status: int, field: str | None, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.field, self.message = status, field, message


@dataclass(frozen=True)
class FeedbackReceipt:
    feedback_id: str
    duplicate: bool  # already recorded (a retry): counted once
    calls: int  # the calls it scores


def feedback(value: float, *, response_id: str | None = None, call_id: str | None = None,
             episode_id: str | None = None, name: str = "reward", timestamp: float | None = None,
             feedback_id: str | None = None, base_url: str | None = None, api_key: str | None = None,
             timeout: float = 30.0) -> FeedbackReceipt:
    """Send one reward for exactly one of `response_id` (a reply's `id`), `call_id` (its `x-lightning-call-id`
    header) or `episode_id` (the trace id its calls carried). `base_url`/`api_key`: the served address
    (".../v1") and its key; default OPENAI_BASE_URL / OPENAI_API_KEY, as the app's OpenAI client reads them.
    `feedback_id` makes retries idempotent (default: one reward per target, name and value; docs/serve.md)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"value: expected a finite number; got {value!r}")  # nothing non-finite is ever sent
    base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "").rstrip("/")
    api_key = api_key or os.environ.get("OPENAI_API_KEY")
    if not base_url or not api_key:
        raise ValueError("base_url and api_key: expected the served address and its key (or OPENAI_BASE_URL and "
                         "OPENAI_API_KEY set)")
    body = {"value": value, "name": name, "timestamp": time.time() if timestamp is None else timestamp,
            "response_id": response_id, "call_id": call_id, "episode_id": episode_id, "feedback_id": feedback_id}
    reply = httpx.post(f"{base_url}/feedback", json={k: v for k, v in body.items() if v is not None},
                       headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
    try:
        data = reply.json()
    except ValueError:
        data = {}
    if reply.status_code != 200:
        error = data.get("error") if isinstance(data, dict) else None
        error = error if isinstance(error, dict) else {}
        raise FeedbackRefused(reply.status_code, error.get("param"), str(error.get("message") or reply.text[:300]))
    return FeedbackReceipt(data["feedback_id"], bool(data["duplicate"]), int(data["calls"]))
