"""The generation thread: its queue, admission, and the continuous-batching loop.

One generation thread owns the model and runs continuous batching: a decode loop for one adapter (or the base)
takes every pending request for it (up to `max_batch_size` rows, one row per choice), prefills them together
(left-padded prompts), then samples one token per step from the KV cache. Between steps, requests for the same
adapter that arrived meanwhile join: they are prefilled on their own and their cache rows are merged into the
running batch (left-padded to a common length, the padding masked out). Finished rows are dropped from the batch
(and the cache) as they finish, so a long reply makes neither the short ones nor the newcomers wait for it. The
loop ends when it runs empty, or stops taking newcomers once a request for another adapter or an adapter
load/unload is waiting, so those are never starved.

The scheduler decides which requests run together and when; the engine's model calls (prefill, one decode
step, the adapter to run under) are handed to it, so this file holds no model code.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_sdk.engine.batch import DecodeBatch, mergeable
from lightning_sdk.engine.requests import ModelNotFound, RequestError, Job, set_future

log = logging.getLogger("lightning_sdk.servers")


_STOP = object()  # queued by close(): the generation thread ends


@dataclass
class _Control:
    """Work that must not overlap generation (adapter load/unload), run on the generation thread."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class Scheduler:
    """Runs queued jobs in continuous batches, and control work between batches, on one daemon thread."""

    def __init__(self, prefill: Callable[[list[Job]], DecodeBatch | None],
                 forward: Callable[[DecodeBatch, torch.Tensor], None],
                 adapter_context: Callable[[str | None], AbstractContextManager], *,
                 max_batch_size: int, stats: dict[str, int]):
        self._prefill, self._forward, self._adapter_context = prefill, forward, adapter_context
        self.max_batch_size = max_batch_size
        self.stats = stats  # the engine's counters, shared
        self._queue: queue.Queue[Job | _Control | object] = queue.Queue()
        self._backlog: collections.deque[Job | _Control | object] = collections.deque()
        self._thread = threading.Thread(target=self._loop, name="lightning-generate", daemon=True)
        self._thread.start()

    # ---- used from the event loop ----

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    async def control(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        ctl = _Control(fn, loop, loop.create_future())
        self._queue.put(ctl)
        return await ctl.future

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    # ---- the generation thread ----

    def _next(self, block: bool) -> Job | _Control | object | None:
        if self._backlog:
            return self._backlog.popleft()
        try:
            return self._queue.get(block=block)
        except queue.Empty:
            return None

    def _loop(self) -> None:
        while True:
            item = self._next(block=True)
            if item is _STOP:
                return
            if isinstance(item, _Control):
                self._run_control(item)
            elif not item.cancelled:
                self._decode_loop(item)

    def _run_control(self, ctl: _Control) -> None:
        try:
            result = ctl.fn()
        except Exception as e:
            ctl.loop.call_soon_threadsafe(set_future, ctl.future, e)
        else:
            ctl.loop.call_soon_threadsafe(set_future, ctl.future, result)

    def _admit(self, adapter: str | None, rows: int) -> tuple[list[Job], bool]:
        """Pending jobs for `adapter` that fit beside `rows` running rows, and whether to go on admitting.

        Anything else that is pending goes back to the front of the backlog in its order. Once something waits
        that cannot join (another adapter, a control item, a job too big for the room left), the loop admits
        no more, so that it runs empty and the waiting item goes next. A control item ends the scan: jobs
        queued after an adapter load/unload must run after it.
        """
        admitted: list[Job] = []
        held: list[Job | _Control | object] = []
        while rows < self.max_batch_size:
            item = self._next(block=False)
            if item is None:
                break
            if not isinstance(item, Job):
                held.append(item)
                break
            if item.cancelled:
                continue
            if item.req.adapter != adapter or rows + item.req.n > self.max_batch_size:
                held.append(item)
                continue
            admitted.append(item)
            rows += item.req.n
        self._backlog.extendleft(reversed(held))
        return admitted, not held

    def _decode_loop(self, first: Job) -> None:
        """One continuous-batching loop for `first`'s adapter; resolves every job it took, errors included."""
        adapter = first.req.adapter
        taken = [first]
        try:
            with torch.inference_mode(), self._adapter_context(adapter):
                self._run(adapter, first, taken)
        except (RequestError, ModelNotFound) as e:  # e.g. the adapter was unloaded while queued
            for job in taken:
                if not job.done:
                    job.finish(e)
        except Exception as e:  # one broken batch must not take the server down
            log.exception("generation failed")
            for job in taken:
                if not job.done:
                    job.finish(RuntimeError(f"generation failed: {e}"))

    def _run(self, adapter: str | None, first: Job, taken: list[Job]) -> None:
        more, admitting = self._admit(adapter, first.req.n)
        newcomers = [first, *more]
        taken += more
        batch: DecodeBatch | None = None
        while True:
            if batch is not None:  # one decode step for the running rows
                self._forward(batch, batch.tokens.unsqueeze(1))
                if admitting:
                    newcomers, admitting = self._admit(adapter, len(batch.rows))
                    taken += newcomers
                    self.stats["joined"] += len(newcomers) if batch.rows else 0
            if newcomers and (batch is None or not batch.rows):
                self.stats["batches"] += 1  # a batch starts from nothing (newcomers into an emptied one too)
            if newcomers:
                fresh = self._prefill(newcomers)
                newcomers = []
                if fresh is not None:
                    batch = fresh if batch is None or not batch.rows else batch.join(fresh)
                    # A cache that cannot be merged (sliding-window, recurrent layers): newcomers wait for the
                    # next loop instead.
                    admitting = admitting and mergeable(batch.cache)
            if batch is None or not batch.rows:
                return
