"""One GPU shared in time by `lightning serve`: the learner's update takes the GPU from vLLM and gives it back.

`lightning serve` places its processes as `lightning run` does (placement.place, its defaults set:
placement.defaults_for): the servers on the serving GPUs, the learner's trainer (one process) on the first of the
placement's train GPUs. The turn is taken only where that GPU is also a serving one (`takes_turn`: one GPU, or
[devices] that overlap), the trainer is on CUDA, and the servers are vLLM with serve.sleep_level >= 1 (and can sleep,
`sleeps`: every replica). Elsewhere (2+ GPUs by default: vLLM and the trainer on GPUs of their own, vLLM awake at
serve.sleep_level = 0; a trainer on the CPU; the built-in server; vLLM with serve.sleep_level = 0, as on its CPU
build) no turn is taken: serving goes on through the update and the trainer stays resident on its own device.

The turn: the gateway's door closes (new calls wait in the gateway, gateway/door.py), the calls at vLLM finish, vLLM
sleeps (runtime.handover.gpu_handover, the one `lightning run` uses: its weights to CPU memory, its KV cache
dropped), the trainer is made from its parent's checkpoint and steps in the memory freed, saves, leaves the GPU
(production.learner's `release`), vLLM wakes and the door opens: the calls that waited are answered then. So between
updates vLLM has the GPU's whole serve.gpu_memory_utilization share, and no phase holds two copies of the model's
weights on the GPU. The gate needs no turn: it scores on the serving backend itself (production.promotion.
eval_scorer), with vLLM awake. A failed update still releases the trainer and wakes vLLM before the door opens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from lightning_sdk.config import Config
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.placement import Placement
from lightning_sdk.runtime.handover import gpu_handover
from lightning_sdk.servers import SleepableServer

WAKE_TRIES = 3  # after a failed update: how often the turn asks vLLM to wake before it gives up (and says so)
DRAIN_S = 600.0  # the longest the turn waits for the calls at vLLM to finish before it gives up (the update fails)

log = logging.getLogger("lightning_sdk")

Turn = Callable[[dict[str, float]], AbstractContextManager[None]]


def sleeps(server: object) -> bool:
    return isinstance(server, SleepableServer) and server.can_sleep


def takes_turn(cfg: Config, placement: Placement, backend: str) -> bool:
    """Whether `lightning serve`'s updates take the GPU from the servers (`backend`: serve.backend resolved): only
    where the learner's trainer (on the first of the placement's train GPUs) is on CUDA, on a GPU a server is on,
    and the servers are vLLM set to sleep (serve.sleep_level >= 1, after placement.defaults_for)."""
    device = cfg.train.device
    on_cuda = device in ("auto", "cuda") or device.startswith("cuda:")
    return (cfg.learn is not None and backend == "vllm" and cfg.serve.sleep_level >= 1 and on_cuda
            and bool(placement.train) and placement.train[0] in placement.serving)


def gpu_turn(gateway: Gateway, server: object, drain_s: float = DRAIN_S) -> Turn:
    """The context an update runs in (for a server that `sleeps`): the door closed and the server asleep; the timings
    (drain_s, sleep_s, wake_s, held_s: the door closed, calls_held: calls that waited) written into the dict given."""

    @contextmanager
    def turn(timings: dict[str, float]) -> Iterator[None]:
        t, waited = time.perf_counter(), gateway.door.waited
        try:
            with gateway.door.closed(drain_s):
                timings["drain_s"] = time.perf_counter() - t
                try:
                    with gpu_handover(server, timings):
                        yield
                except BaseException:
                    # The update (or the wake itself) failed: gpu_handover wakes only after a body that returned,
                    # and the door must not open onto a server asleep.
                    awake(server)
                    raise
        finally:
            timings["held_s"] = time.perf_counter() - t
            timings["calls_held"] = float(gateway.door.waited - waited)

    return turn


def awake(server: object, tries: int = WAKE_TRIES) -> None:
    """Wake the server after a failed update (waking one awake does nothing); said in the log when it will not."""
    for i in range(1, tries + 1):
        try:
            server.wake_up()  # type: ignore[attr-defined]
            return
        except Exception as e:  # noqa: BLE001 - tried again, then said: the update's own error is raised
            log.error("learn: vLLM did not wake after a failed update (try %d of %d): %s: %s", i, tries,
                      type(e).__name__, str(e)[:300])
            time.sleep(1.0)
