"""The remote runtime's book of work: the phase's rollouts waiting for a worker, the claims on them (each with a
deadline), and the results and spans workers send back.

Shared by the HTTP routes (`routes.py`, on the gateway's thread) and the collector (`remote.py`, on the
runtime's thread) under one lock. The server writes every rollout row itself: started when a worker claims it,
finished when its result comes; a claim past its deadline is abandoned by the collector (`expire`). Only a
rollout claimed right now takes spans or a result, so nothing a dead or late worker sends is counted twice.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from lightning_sdk.rollouts.remote.protocol import LONG_POLL_S, Result
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk import tracing
from lightning_sdk.agent import RewardError, reward_value
from lightning_sdk.gateway.capture import OpenRollouts
from lightning_sdk.store import Store
from lightning_sdk.rollouts.remote.otlp import Decoded
from lightning_sdk.rollouts.episode import export_root
from lightning_sdk.tracing.context import new_span_id
from lightning_sdk.tracing.records import CLAIM, REWARD_SPAN, REWARD_VALUE

MAX_WORKER_NAMES = 4096  # worker names remembered (the goodbye waits only for those heard from lately)
RECENT_S = LONG_POLL_S + 5  # a worker heard from this lately may still be polling: the goodbye gives it a moment


@dataclass
class Claimed:
    """A rollout a worker holds: until `deadline` (time.monotonic), or until its result comes."""

    index: int  # the job's place in the phase's list
    job: RolloutJob
    worker: str
    deadline: float
    generation: int  # the collector's inference-server generation when it was claimed (see remote.py)
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    fault: str | None = None  # what a worker sent wrong for it: it fails with this line when its result comes
    # The rollout's own span, drawn here (so the root the run exports is the one its spans name) and when it started
    span_id: str = field(default_factory=new_span_id)
    start_ns: int = field(default_factory=time.time_ns)

    def holds(self, secret: object) -> bool:
        return isinstance(secret, str) and hmac.compare_digest(secret.encode(), self.secret.encode())


@dataclass
class Finished:
    claim: Claimed
    result: RolloutResult


@dataclass
class Spans:
    """What one OTLP export left in the store, and what it refused (by reason)."""

    stored: int = 0
    refused: Counter = field(default_factory=Counter)
    forbidden: str | None = None  # spans for a rollout another worker holds: the whole export is refused (403)

    @property
    def rejected(self) -> int:
        return sum(self.refused.values())

    def message(self) -> str:
        return "; ".join(f"{n} span(s) {reason}" for reason, n in sorted(self.refused.items()))


class Forbidden(Exception):
    """A result or spans for a rollout whose claim's secret the sender does not hold."""


class Dispatch:
    def __init__(self, store: Store, *, rollouts: OpenRollouts | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.clock = store, clock
        self.rollouts = rollouts or OpenRollouts()  # the gateway's: a claimed rollout's calls are attributed
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the collector waits on it for results
        self._queue: deque[tuple[int, RolloutJob]] = deque()
        self._claims: dict[str, Claimed] = {}
        self._finished: list[Finished] = []
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()  # long-polling claims
        self.policy: str | None = None
        self.label: str | None = None
        self.timeout = 0.0  # rollout.timeout: what a worker gives the agent (set per phase)
        self.deadline_s = 0.0  # seconds a claim holds: rollout.timeout + remote.grace (set per phase)
        self.generation = 0
        self.over = False
        self.last_contact = float("-inf")  # any request from any worker
        # worker -> its last request, oldest first; workers that have heard the run is over. Both bounded: any key
        # holder can send a name of its own with every request.
        self.seen: OrderedDict[str, float] = OrderedDict()
        self.told_over: OrderedDict[str, None] = OrderedDict()
        self.spans_refused: Counter = Counter()  # for the whole run, by reason

    # --------------------------------------------------------------------------------- the collector's side

    def open(self, jobs: list[tuple[int, RolloutJob]], *, policy: str, label: str, timeout: float,
             deadline_s: float) -> None:
        """Queue a phase's jobs (index, job); claims of an earlier phase are gone by now."""
        with self._lock:
            self.policy, self.label, self.timeout, self.deadline_s = policy, label, timeout, deadline_s
            self._queue.extend(jobs)
        self._wake()

    def requeue(self, index: int, job: RolloutJob) -> None:
        with self._lock:
            self._queue.appendleft((index, job))  # first: it has waited longest
        self._wake()

    def close_phase(self) -> None:
        """The phase ended (all results in, or the run stopped): nothing of it is claimed or taken any more."""
        with self._lock:
            for c in self._claims.values():
                self.rollouts.close(c.job.trace_id)
            self._queue.clear()
            self._claims.clear()
            self._finished.clear()
            self.label = None

    def end(self) -> None:
        """The run is over: claims are answered so (410) from now on."""
        with self._lock:
            self.over = True
        self._wake()

    def wait(self, timeout: float) -> list[Finished]:
        """Results that came in since the last call, waiting up to `timeout` seconds for one."""
        with self._changed:
            if not self._finished:
                self._changed.wait(timeout)
            out, self._finished = self._finished, []
            return out

    def expire(self) -> list[Claimed]:
        """Claims past their deadline, taken back (the collector abandons them in the store and re-queues)."""
        now = self.clock()
        with self._lock:
            late = [c for c in self._claims.values() if c.deadline <= now]
            for c in late:
                del self._claims[c.job.rollout_id]
                self.rollouts.close(c.job.trace_id)
            return late

    def counts(self) -> tuple[int, int]:
        """(rollouts waiting for a worker, rollouts claimed)."""
        with self._lock:
            return len(self._queue), len(self._claims)

    # ------------------------------------------------------------------------------------ the routes' side

    def touch(self, worker: str | None) -> None:
        now = self.clock()
        with self._lock:
            self.last_contact = now
            if worker is not None:
                self.seen[worker] = now
                self.seen.move_to_end(worker)
                while len(self.seen) > MAX_WORKER_NAMES or next(iter(self.seen.values())) < now - RECENT_S:
                    self.seen.popitem(last=False)

    def claim_now(self, worker: str) -> Claimed | None:
        """The next waiting rollout, now claimed by `worker` (its row started in the store); None if none waits."""
        self.touch(worker)
        with self._lock:
            if self.over or not self._queue:
                return None
            index, job = self._queue.popleft()
            claim = Claimed(index, job, worker, self.clock() + self.deadline_s, self.generation)
            self._claims[job.rollout_id] = claim
            self.rollouts.open(job.trace_id, job.rollout_id, job.attempt, job.phase, seed=job.seed,
                               secret=claim.secret)
            policy = self.policy
        self.store.start_rollout(job.rollout_id, task_id=job.task_id, group_id=job.group_id, iteration=job.iteration,
                                 phase=job.phase, attempt=job.attempt, model=policy)
        return claim

    async def claim(self, worker: str, wait_s: float, gone: Callable[[], Awaitable[bool]]) -> Claimed | None:
        """`claim_now`, waiting up to `wait_s` seconds (long poll) for work to come; None if none came, or if the
        worker went away meanwhile (`gone`: a killed worker's poll must not take work nobody will do)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        while True:
            # Asked every round, the first one too: that first ask also makes the server watch the connection.
            if await gone():
                return None
            woken = loop.create_future()
            waiter = (loop, woken)
            with self._lock:
                self._waiters.add(waiter)  # before looking: work queued meanwhile wakes it
            try:
                claim = await asyncio.to_thread(self.claim_now, worker)  # a store write: off the event loop
                left = until - loop.time()
                if claim is not None or self.over or left <= 0:
                    return claim
                try:
                    await asyncio.wait_for(woken, left)
                except asyncio.TimeoutError:
                    pass
            finally:
                with self._lock:
                    self._waiters.discard(waiter)

    def holds(self, rollout_id: str, secret: object) -> bool:
        """Whether `secret` is the claim's of a rollout claimed now."""
        with self._lock:
            claim = self._claims.get(rollout_id)
            return claim is not None and claim.holds(secret)

    def finish(self, rollout_id: str, result: Result | str, secret: object) -> RolloutResult | None:
        """Record a worker's result (or, given a string, the one line saying why its result body was refused: the
        rollout fails with it); None (and nothing recorded) if the rollout is not claimed right now; Forbidden if
        the sender does not hold its claim's secret."""
        worker = result.worker if isinstance(result, Result) else None
        self.touch(worker)
        with self._lock:
            claim = self._claims.get(rollout_id)
            if claim is None:
                return None
            if not claim.holds(secret):
                raise Forbidden(rollout_id)
            del self._claims[rollout_id]
            self.rollouts.close(claim.job.trace_id)
        if isinstance(result, str) or claim.fault is not None:
            error = claim.fault if claim.fault is not None else f"the worker's result was refused: {result}"
            output = result.output if isinstance(result, Result) else None
            self.store.finish_rollout(rollout_id, status="failed", output=output, error=error)
            done = RolloutResult(claim.job, "failed", None, output, error, failed_in="worker")
        else:
            self.store.finish_rollout(rollout_id, status=result.status, output=result.output, reward=result.reward,
                                      error=result.error, traceback=result.traceback)
            done = RolloutResult(claim.job, result.status, result.reward, result.output, result.error,
                                 failed_in=result.failed_in)
        # The root of the rollout's trace in the run's collector, from what was accepted here: its spans came before
        # the result (the worker reports only once they are stored), so the tree is whole once the root is out.
        export_root(done, span_id=claim.span_id, start_ns=claim.start_ns,
                    agent=result.agent if isinstance(result, Result) and result.agent else "rollout")
        with self._changed:
            self._finished.append(Finished(claim, done))
            self._changed.notify_all()
        return done

    def take_spans(self, decoded: Decoded) -> Spans:
        """Store the spans of rollouts claimed right now (by their attempt, with their claim's secret, which is
        then dropped); refuse and count the rest. One span for a claimed rollout without its secret refuses the
        whole export (`Spans.forbidden`): nothing of it is stored."""
        out = Spans()
        if decoded.without_rollout:
            out.refused["without lightning.rollout.id"] += decoded.without_rollout
        keep = []
        with self._lock:
            for r in decoded.records:
                claim = self._claims.get(r.rollout_id)
                if claim is None:
                    out.refused["for a rollout not claimed now (unknown, finished or abandoned)"] += 1
                elif claim.job.attempt != r.attempt:
                    out.refused["for another attempt of their rollout"] += 1
                elif not claim.holds(r.attributes.pop(CLAIM, None)):
                    out.forbidden = (f"span {r.span_id[:32]} is for rollout {r.rollout_id[:200]!r}, whose claim this "
                                     f"sender does not hold (its `{CLAIM}` attribute is missing or wrong)")
                    return out
                elif (fault := _bad_reward(r)) is not None:
                    claim.fault = claim.fault or fault
                    out.refused["rewards that are not finite numbers within the bound (their rollout fails)"] += 1
                else:
                    keep.append(r)
        conflicts = self.store.write_spans(keep) if keep else []
        if conflicts:
            out.refused["whose span id another stored span holds"] += len(conflicts)
        out.stored = len(keep) - len(conflicts)
        taken = set(conflicts)
        tracing.export_received([r for r in keep if r.span_id not in taken])  # run.otlp_endpoint, the app's provider
        with self._lock:
            self.spans_refused.update(out.refused)
        return out

    def mark_told(self, worker: str) -> None:
        with self._lock:
            self.told_over[worker] = None
            self.told_over.move_to_end(worker)
            if len(self.told_over) > MAX_WORKER_NAMES:
                self.told_over.popitem(last=False)

    def untold(self) -> list[str]:
        """Workers heard from lately (RECENT_S) that have not yet heard the run is over."""
        since = self.clock() - RECENT_S
        with self._lock:
            return [w for w, t in self.seen.items() if t >= since and w not in self.told_over]

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_settle, future)
            except RuntimeError:  # that loop has closed (the gateway stopped)
                pass


def _bad_reward(r) -> str | None:
    """The one line naming what is wrong with a reward span's value, or None (not a reward span, or a good one)."""
    if r.name != REWARD_SPAN:
        return None
    try:
        reward_value(r.attributes.get(REWARD_VALUE), f"span {r.span_id[:32]} ({REWARD_SPAN}): {REWARD_VALUE} =")
    except RewardError as e:
        return str(e)
    return None


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
