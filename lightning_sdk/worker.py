"""Rollout workers: run one episode of the user's agent inside its rollout context, score it, record it.

An agent that raises, hangs past the timeout, or whose reward is not a finite number becomes a *failed*
rollout with the error and traceback in the store; it never reaches training and never stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from lightning_sdk.agent import LLM
from lightning_sdk.store import Store
from lightning_sdk import tracing


@dataclass(frozen=True)
class RolloutJob:
    rollout_id: str
    task_id: str
    group_id: str
    task: dict
    iteration: int
    phase: str = "train"  # 'train' | 'eval'
    attempt: int = 1


@dataclass(frozen=True)
class RolloutResult:
    job: RolloutJob
    status: str  # 'succeeded' | 'failed'
    reward: float | None
    output: Any = None
    error: str | None = None


class RewardError(ValueError):
    pass


def check_reward(value: Any, rollout_id: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"@reward returned {value!r} ({type(value).__name__}) for rollout {rollout_id}; "
                          f"expected a finite float")
    return float(value)


async def _call(fn: Callable, *args: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    # to_thread copies the context, so spans made in the thread still carry the rollout id.
    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


async def run_rollout(job: RolloutJob, *, rollout_fn: Callable, reward_fn: Callable, llm: LLM, store: Store,
                      timeout: float) -> RolloutResult:
    store.start_rollout(job.rollout_id, task_id=job.task_id, group_id=job.group_id, iteration=job.iteration,
                        phase=job.phase, attempt=job.attempt, model=llm.model)
    output = None
    try:
        with tracing.rollout_context(job.rollout_id, job.attempt):
            try:
                output = await asyncio.wait_for(_call(rollout_fn, job.task, llm), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"rollout {job.rollout_id} took longer than rollout.timeout={timeout}s") from None
        value = check_reward(await _call(reward_fn, job.task, output), job.rollout_id)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        store.finish_rollout(job.rollout_id, status="failed", output=output, error=error,
                             traceback=traceback.format_exc())
        return RolloutResult(job, "failed", None, output, error)
    store.finish_rollout(job.rollout_id, status="succeeded", output=output, reward=value)
    return RolloutResult(job, "succeeded", value, output)
