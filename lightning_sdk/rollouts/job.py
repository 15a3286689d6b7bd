"""A rollout to run (`RolloutJob`) and what came of it (`RolloutResult`): what every runtime passes around."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RolloutJob:
    rollout_id: str
    task_id: str
    group_id: str
    task: dict
    iteration: int
    phase: str = "train"  # 'train' | 'eval'
    attempt: int = 1

    def retry(self) -> "RolloutJob":
        """The same rollout run once more, as a new attempt under a new id (the old one stays, abandoned)."""
        base = self.rollout_id.removesuffix(f"-r{self.attempt}") if self.attempt > 1 else self.rollout_id
        return dataclasses.replace(self, rollout_id=f"{base}-r{self.attempt + 1}", attempt=self.attempt + 1)


@dataclass(frozen=True)
class RolloutResult:
    job: RolloutJob
    status: str  # 'succeeded' | 'failed'
    reward: float | None
    output: Any = None
    error: str | None = None
    failed_in: str | None = None  # 'rollout' | 'reward': which user function failed
