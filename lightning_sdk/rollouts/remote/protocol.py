"""The remote runtime's wire protocol: the routes a worker calls and their JSON bodies (docs/remote.md).

Shared by the server (`rollouts/remote/routes.py`, which validates every body with these models) and the Lightning
Client (`lightning_sdk/rollouts/remote/worker.py`); it needs pydantic only, so the client's environment stays light.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lightning_sdk.agent import MAX_ABS_REWARD
from lightning_sdk.rollouts.job import RolloutJob
# On a result and on the rollout's LLM calls: the claim's secret; spans carry it as `lightning.claim`
from lightning_sdk.tracing.propagation import CLAIM_HEADER

__all__ = ["CLAIM", "CLAIM_HEADER", "RESULT", "RUN", "TRACES", "TOKEN_FILE", "SERVER_FILE", "LONG_POLL_S",
           "ClaimRequest", "Endpoint", "Claim", "Result", "RunInfo", "previous_port"]

CLAIM = "/v1/work/claim"  # POST ClaimRequest -> 200 Claim | 204 nothing to do yet | 410 the run is over
RESULT = "/v1/work/{rollout_id}/result"  # POST Result -> 200 | 409 not (or no longer) claimed: ignored
RUN = "/v1/run"  # GET -> RunInfo
TRACES = "/v1/traces"  # POST OTLP/HTTP ExportTraceServiceRequest (protobuf or JSON)

TOKEN_FILE, SERVER_FILE = "worker.token", "server.json"  # in the run directory: the key, and {"url": ...}
LONG_POLL_S = 20.0  # a claim waits at most this long for work before it is answered 204


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _plain_name(v: str) -> str:
    # A worker's name is printed and logged by the server: a newline or an ANSI/OSC escape in it would forge a line
    # or drive the terminal.
    if not v.isprintable():
        raise ValueError("holds a control character (a newline, an escape...); expected a plain name")
    return v


class ClaimRequest(_Body):
    worker: str = Field(min_length=1, max_length=200, description="who claims: shown in the server's log")

    _plain = field_validator("worker")(_plain_name)


class Endpoint(BaseModel):
    """Where the rollout's LLM calls go: the run's OpenAI-compatible server, serving the policy being trained.
    `base_url` is the rollout's own (`.../rollouts/{trace_id}/v1`): a client that sends no W3C traceparent is
    still known by it."""

    base_url: str
    api_key: str
    model: str


class Claim(BaseModel):
    rollout_id: str
    task_id: str
    group_id: str
    task: dict[str, Any]
    iteration: int
    phase: Literal["train", "eval"]
    attempt: int
    timeout: float  # rollout.timeout: the agent's time, and again the reward's
    deadline_s: float  # seconds from now: a result later than this is refused (the rollout re-runs elsewhere)
    llm: Endpoint
    trace_id: str  # the rollout's OpenTelemetry trace id: its LLM calls carry it (W3C traceparent)
    secret: str  # the claim's own key: its spans (`lightning.claim`) and result (CLAIM_HEADER) need it
    # The rollout's own span (16 hex digits), the parent of its calls and spans: the server exports it, the root of
    # the rollout's trace, to the run's collector when the result comes (the worker's own collector gets it too).
    span_id: str | None = Field(None, pattern=r"^[0-9a-f]{16}$")

    def job(self) -> RolloutJob:
        return RolloutJob(rollout_id=self.rollout_id, task_id=self.task_id, group_id=self.group_id, task=self.task,
                          iteration=self.iteration, phase=self.phase, attempt=self.attempt, trace_id=self.trace_id)


class Result(_Body):
    worker: str = Field(min_length=1, max_length=200)
    status: Literal["succeeded", "failed"]
    output: Any = None
    reward: float | None = Field(None, strict=True, description="a finite number when succeeded")
    error: str | None = None
    traceback: str | None = None
    failed_in: Literal["rollout", "reward"] | None = Field(None, description="which user function failed")
    agent: str | None = Field(None, min_length=1, max_length=200,
                              description="the @rollout function's name: the root span's `invoke_agent <agent>`")

    _plain = field_validator("worker", "agent")(_plain_name)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number or null")
        if v is not None and abs(v) > MAX_ABS_REWARD:  # the bound a reward function's value is held to
            raise ValueError(f"{v!r} is beyond the bound: expected a reward within +-{MAX_ABS_REWARD:g}")
        return v

    @model_validator(mode="after")
    def _scored(self):
        if self.status == "succeeded" and self.reward is None:
            raise ValueError("reward: a succeeded rollout needs a finite reward")
        return self


class RunInfo(BaseModel):
    name: str
    phase: str | None  # the label of the phase being collected ("iteration 3/30", "eval (untrained)"), or None
    over: bool  # the run has ended: workers exit
    redirect_openai: bool  # agent.redirect_openai: workers point OPENAI_BASE_URL / OPENAI_API_KEY at the server
    api_key: str  # the key agents call the run's LLM routes with (it opens no work route)


def previous_port(run_dir: Path) -> int:
    """The port a killed remote run of `run_dir` served on (its SERVER_FILE, which a clean stop removes), or 0: a
    resumed run serves there again if it can, so that the workers given its URL reach it again."""
    try:
        port = urlsplit(json.loads((Path(run_dir) / SERVER_FILE).read_text())["url"]).port
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return port or 0
