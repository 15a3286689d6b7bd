"""Rollout workers: run one episode of the user's agent inside its rollout context, score it, record it.

An agent that raises, hangs past the timeout, or whose reward is not a finite number becomes a *failed*
rollout with the error and traceback in the store; it never reaches training and never stops the run (the
runtime decides about runs: see `rollout.on_reward_error` and the majority-failed stop). An agent that returns
nothing (None) is not a failure by itself: None goes to `@reward` like any output, and the rollout fails only if
the reward cannot score it. See docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import json
import threading
import time
import traceback
from typing import Any, Callable, Protocol

from lightning_sdk.agent import LLM, RewardError, no_reply_cache, reward_value, rollout_args
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.tracing.context import RolloutContext, rollout_context
from lightning_sdk.tracing.instrument import export_rollout, exporting
from lightning_sdk.tracing.records import GROUP_ID, ITERATION, PHASE, REWARD_VALUE, ROLLOUT_STATUS, TASK_ID


class RolloutSink(Protocol):
    """Where a rollout's row goes: the store, or the Ray runtime's writer actor."""

    def start_rollout(self, rollout_id: str, **kw: Any) -> None: ...
    def finish_rollout(self, rollout_id: str, **kw: Any) -> None: ...


class AgentAborted(RuntimeError):
    """The user's function raised SystemExit, KeyboardInterrupt or CancelledError of its own: it fails that
    rollout. Only a real Ctrl-C (or the runtime's own cancellation, e.g. a timeout) stops more than that."""


async def _call(fn: Callable, *args: Any) -> Any:
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        result = await _in_thread(fn, *args)
        return await result if inspect.isawaitable(result) else result
    except asyncio.CancelledError as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # we are being cancelled (Ctrl-C, rollout.timeout): go on
            raise
        raise AgentAborted(_aborted(fn, e)) from None
    except (SystemExit, KeyboardInterrupt) as e:
        # A real Ctrl-C never lands here: it reaches the main thread's event loop, which cancels the collection.
        # This one was raised by the agent's own code (sys.exit() in a rollout), or in its thread.
        raise AgentAborted(_aborted(fn, e)) from None


def _aborted(fn: Callable, e: BaseException) -> str:
    return (f"{getattr(fn, '__qualname__', fn)} raised {type(e).__name__}({', '.join(map(repr, e.args))}); it "
            f"fails this rollout only (a real Ctrl-C stops the run)")


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # the rollout timed out meanwhile: nobody waits for this thread any more
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


async def _in_thread(fn: Callable, *args: Any) -> Any:
    """Run a sync function in a thread of its own, with the caller's context (so spans carry the rollout id).

    Not the loop's default pool: Python cannot kill a thread, so a sync agent that hangs past rollout.timeout
    keeps its thread; in a bounded pool such threads would starve later rollouts, and at exit the pool joins
    its threads, so one hung agent would keep the run from ever ending. A daemon thread costs neither.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    ctx = contextvars.copy_context()

    def target() -> None:
        try:
            value, error = ctx.run(fn, *args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting rollout
            value, error = None, e
        try:
            loop.call_soon_threadsafe(_settle, future, value, error)
        except RuntimeError:  # the loop is closed: the run ended while this thread hung
            pass

    threading.Thread(target=target, name=f"lightning-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


def _describe(e: BaseException, job: RolloutJob) -> str:
    error = f"{type(e).__name__}: {e}"
    key = e.args[0] if isinstance(e, KeyError) and e.args else None
    if isinstance(key, str) and key not in job.task:  # the usual cause: a dataset row without the field
        fields = ", ".join(map(repr, job.task)) or "none"
        error += (f" (task {job.task_id} has no field {key!r}; its fields: {fields}. List the fields the agent "
                  f"reads in data.required_fields to check every row when the dataset loads)")
    return error


async def run_rollout(job: RolloutJob, *, rollout_fn: Callable, reward_fn: Callable, llm: LLM, store: RolloutSink,
                      timeout: float, claim: str | None = None, span_id: str | None = None) -> RolloutResult:
    """Run one episode in the job's rollout context (its trace id; a remote worker's `claim` secret and the root
    `span_id` its claim gave) and score it; the rollout's row goes to `store`."""
    store.start_rollout(job.rollout_id, task_id=job.task_id, group_id=job.group_id, iteration=job.iteration,
                        phase=job.phase, attempt=job.attempt, model=llm.model)
    output, stage, ctx, start_ns = None, "rollout", None, time.time_ns()
    no_reply_cache()
    try:
        with rollout_context(job.rollout_id, job.attempt, trace_id=job.trace_id, claim=claim,
                             span_id=span_id) as ctx:
            # its own copy of the task: an agent that edits it must not change it for the rest of its group
            args = rollout_args(rollout_fn, copy.deepcopy(job.task), llm)
            try:
                output = await asyncio.wait_for(_call(rollout_fn, *args), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"rollout {job.rollout_id} took longer than rollout.timeout={timeout}s") from None
        stage = "reward"
        try:
            raw = await asyncio.wait_for(_call(reward_fn, copy.deepcopy(job.task), output), timeout)
        except asyncio.TimeoutError:
            raise RewardError(f"@reward for rollout {job.rollout_id} took longer than rollout.timeout="
                              f"{timeout}s") from None
        value = reward_value(raw, "@reward returned", f" for rollout {job.rollout_id}")
    except Exception as e:
        error = _describe(e, job)
        if stage == "reward" and not isinstance(e, RewardError):
            error = f"@reward raised {error} for rollout {job.rollout_id}"
        store.finish_rollout(job.rollout_id, status="failed", output=output, error=error,
                             traceback=traceback.format_exc())
        return _exported(RolloutResult(job, "failed", None, output, error, failed_in=stage), ctx, rollout_fn, start_ns)
    store.finish_rollout(job.rollout_id, status="succeeded", output=output, reward=value)
    return _exported(RolloutResult(job, "succeeded", value, output), ctx, rollout_fn, start_ns)


def _exported(result: RolloutResult, ctx: RolloutContext | None, rollout_fn: Callable, start_ns: int) -> RolloutResult:
    if ctx is not None:
        export_root(result, span_id=ctx.span_id, agent=getattr(rollout_fn, "__name__", "rollout"), start_ns=start_ns)
    return result


def export_root(result: RolloutResult, *, span_id: str, agent: str, start_ns: int) -> None:
    """The rollout's own span, the root of its trace, to the user's tools (when a collector is set): the agent
    invoked on the task, with the reward and status it ended with (gen_ai's `invoke_agent` operation). Made where
    the episode ran, or by the run's server from a remote worker's accepted result (rollouts/remote/dispatch.py)."""
    if not exporting():
        return
    job = result.job
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent, TASK_ID: job.task_id,
        GROUP_ID: job.group_id, ITERATION: job.iteration, PHASE: job.phase, ROLLOUT_STATUS: result.status,
        "input.value": json.dumps(job.task, default=str), "input.mime_type": "application/json",
        "output.value": result.output if isinstance(result.output, str) else json.dumps(result.output, default=str),
    }
    if result.reward is not None:
        attributes[REWARD_VALUE] = result.reward
    ctx = RolloutContext(job.rollout_id, job.attempt, job.trace_id, span_id=span_id)
    export_rollout(ctx, name=f"invoke_agent {agent}", attributes=attributes, start_ns=start_ns,
                   end_ns=time.time_ns(), error=result.error)
