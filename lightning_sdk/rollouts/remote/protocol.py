"""The remote runtime's wire protocol: the routes a worker calls and their JSON bodies (docs/remote.md).

Shared by the server (`rollouts/remote/routes.py`, which validates every body with these models) and the Lightning
Client (`lightning_sdk/rollouts/remote/worker.py`); it needs pydantic only, so the client's environment stays light.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lightning_sdk.rollouts.job import RolloutJob

CLAIM = "/v1/work/claim"  # POST ClaimRequest -> 200 Claim | 204 nothing to do yet | 410 the run is over
RESULT = "/v1/work/{rollout_id}/result"  # POST Result -> 200 | 409 not (or no longer) claimed: ignored
RUN = "/v1/run"  # GET -> RunInfo
TRACES = "/v1/traces"  # POST OTLP/HTTP ExportTraceServiceRequest (protobuf or JSON)

CLAIM_HEADER = "x-lightning-claim"  # on a result: the claim's secret; spans carry it as `lightning.claim`
TOKEN_FILE, SERVER_FILE = "worker.token", "server.json"  # in the run directory: the key, and {"url": ...}
LONG_POLL_S = 20.0  # a claim waits at most this long for work before it is answered 204


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClaimRequest(_Body):
    worker: str = Field(min_length=1, max_length=200, description="who claims: shown in the server's log")


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

    @field_validator("reward")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number or null")
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
