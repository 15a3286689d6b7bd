"""A rollout to run (`RolloutJob`) and what came of it (`RolloutResult`): what every runtime passes around."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any


def new_trace_id() -> str:
    return secrets.token_hex(16)


@dataclass(frozen=True)
class RolloutJob:
    rollout_id: str
    task_id: str
    group_id: str
    task: dict
    iteration: int
    phase: str = "train"  # 'train' | 'eval'
    attempt: int = 1
    # The rollout's OpenTelemetry trace id (32 hex digits): the gateway attributes the calls that carry it (or call
    # its per-rollout base URL, which it names) to this rollout. From the OS: unguessable by other agents.
    trace_id: str = field(default_factory=new_trace_id)
    # An eval rollout's sampling seed (evals.eval_seed): the gateway seeds its calls that set none. None: unseeded.
    seed: int | None = None

    def retry(self) -> "RolloutJob":
        """The same rollout run once more, as a new attempt under a new id (the old one stays, abandoned)."""
        base = self.rollout_id.removesuffix(f"-r{self.attempt}") if self.attempt > 1 else self.rollout_id
        return dataclasses.replace(self, rollout_id=f"{base}-r{self.attempt + 1}", attempt=self.attempt + 1,
                                   trace_id=new_trace_id())


@dataclass(frozen=True)
class RolloutResult:
    job: RolloutJob
    status: str  # 'succeeded' | 'failed'
    reward: float | None
    output: Any = None
    error: str | None = None
    failed_in: str | None = None  # 'rollout' | 'reward': which user function failed
