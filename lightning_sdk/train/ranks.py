"""The data-parallel trainer (train.processes > 1): its processes, launched and driven by the run itself.

The run's process holds no model then. It hosts the rendezvous (a torch.distributed TCPStore on 127.0.0.1, on a
port the OS picks) and starts one process per rank (multiprocessing's spawn: a fresh interpreter, nothing of the
run's threads), each with its own CUDA_VISIBLE_DEVICES on GPUs. Every rank builds the same GRPOTrainer (same seed,
then process 0's adapter broadcast), joins the group (gloo on the CPU, NCCL on GPUs) and waits for commands on a
pipe: each update's whole batch goes to every rank, which trains on its share (train.data_parallel); rank 0 alone
writes checkpoints. A rank that dies ends the run with one line naming it; the others are stopped, never left
waiting in a collective.

Spawn imports the parent's main module again in each rank: `lightning run` is safe; a script that calls
`lightning_sdk.run` with train.processes > 1 needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import time
from collections.abc import Sequence
from contextlib import ExitStack
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from lightning_sdk.config import TrainConfig
from lightning_sdk.errors import RunError

# How long a rank waits for the others to join, and a collective for its peers: a bound, never a hang.
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
RESUME = "the last checkpoint is intact: `lightning run --resume` continues from it"


def rank_devices(config: TrainConfig, devices: Sequence[str] | None = None) -> list[str | None]:
    """Each rank's CUDA_VISIBLE_DEVICES: `devices` (one entry per rank, e.g. from a placement) if given; on GPUs
    (train.device 'cuda', or 'auto' where CUDA is) the visible GPUs in order, one per rank; on the CPU '' (no
    GPU), so a CPU trainer never touches one."""
    if devices is not None:
        if len(devices) != config.processes:
            raise ValueError(f"train.processes = {config.processes}, but {len(devices)} device sets were given")
        return list(devices)
    import torch

    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return [""] * config.processes
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < config.processes:
        raise RunError(f"train.processes = {config.processes} takes one GPU each, but {len(ids)} are visible")
    return ids[:config.processes]


class TrainerProcesses:
    """GRPOTrainer's step / save_state / load_state, run by `config.processes` data-parallel processes."""

    def __init__(self, model_path: str, config: TrainConfig, *, devices: Sequence[str] | None = None,
                 threads: int | None = None, **trainer_kwargs: Any) -> None:
        """`devices`: each rank's CUDA_VISIBLE_DEVICES (rank_devices); `threads`: the CPU threads of all ranks
        together (default: torch's now), shared evenly; the rest as GRPOTrainer takes them."""
        import torch
        import torch.distributed as dist

        self.world = config.processes
        each = rank_devices(config, devices)
        threads = max(1, (threads or torch.get_num_threads()) // self.world)
        # The rendezvous, hosted here: port 0, so parallel runs never clash.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        try:
            for rank in range(self.world):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=rank_main, name=f"lightning-trainer-rank{rank}", daemon=True,
                                args=(rank, self.world, self._store.port, each[rank], threads, theirs, model_path,
                                      config, trainer_kwargs))
                p.start()
                theirs.close()
                self._procs.append(p)
                self._conns.append(mine)
            self._wait(range(self.world), "its start")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def step(self, transitions: Sequence[Any], scored: Any = None) -> dict[str, float]:
        return self._call(range(self.world), "step", "an update", list(transitions), scored)[0]

    def save_state(self, path: str | Path) -> None:
        # Every rank takes part (a sharded adapter is gathered whole first); rank 0 alone writes.
        self._call(range(self.world), "save_state", "a checkpoint write", str(path))

    def held_parameters(self) -> list[dict[str, int]]:
        """Each rank's GRPOTrainer.held_parameters, in rank order."""
        return self._call(range(self.world), "held_parameters", "a count")

    def load_state(self, path: str | Path) -> None:
        self._call(range(self.world), "load_state", "the resume", str(path))

    def _call(self, ranks: Sequence[int], command: str, what: str, *args: Any) -> list[Any]:
        for r in ranks:
            self._alive(what)
            try:
                self._conns[r].send((command, args))
            except OSError:
                self._procs[r].join(timeout=5)
                self._alive(what)
                raise
        return self._wait(ranks, what)

    def _wait(self, ranks: Sequence[int], what: str) -> list[Any]:
        """Each rank's answer, in rank order; a rank that dies or fails meanwhile stops them all (RunError)."""
        pending = {self._conns[r]: r for r in ranks}
        answers: dict[int, Any] = {}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            for ready in wait([*pending, *sentinels]):
                if ready in sentinels:
                    self._alive(what)
                    continue
                r = pending.pop(ready)
                try:
                    status, value = ready.recv()
                except (EOFError, OSError):  # its end of the pipe closed: it is exiting, say how
                    self._procs[r].join(timeout=5)
                    self._alive(what)
                    self.close()
                    raise RunError(f"trainer process {r} of {self.world} stopped answering during {what}; the run "
                                   f"ends here ({RESUME})") from None
                if status == "error":
                    # A peer killed mid-collective fails this rank's collective too: name the dead one, the cause.
                    wait([p.sentinel for p in self._procs], timeout=1.0)
                    self._alive(what)
                    self.close()
                    raise RunError(f"trainer process {r} of {self.world} failed during {what}: {value}")
                answers[r] = value
        return [answers[r] for r in ranks]

    def _alive(self, what: str) -> None:
        for r, p in enumerate(self._procs):
            p.join(timeout=0)
            if p.exitcode is not None:
                how = (f"was killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                       else f"exited with code {p.exitcode}")
                self.close()
                raise RunError(f"trainer process {r} of {self.world} (pid {p.pid}) {how} during {what}; the other "
                               f"processes were stopped and the run ends here ({RESUME})")

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(("stop", ()))
            except OSError:
                pass
            c.close()
        deadline = time.monotonic() + 30  # leaving the group and the interpreter: seconds on a busy machine
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:  # one left waiting in a collective for a dead peer
            if p.exitcode is None:
                p.kill()
                p.join()
        self._conns, self._procs = [], []

    def __enter__(self) -> TrainerProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank_main(rank: int, world: int, port: int, devices: str | None, threads: int, conn: Connection,
              model_path: str, config: TrainConfig, trainer_kwargs: dict[str, Any]) -> None:
    """One rank: join the group, build the trainer, then run commands until told to stop or the run is gone."""
    if devices is not None:  # before torch initialises CUDA, which reads it once
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    import torch
    import torch.distributed as dist

    from lightning_sdk.train.data_parallel import process_group
    from lightning_sdk.train.trainer import GRPOTrainer

    torch.set_num_threads(threads)
    try:
        gpu = bool(devices) and torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(0)
            config = config.model_copy(update={"device": "cuda"})  # this rank's own GPU, cuda:0 in its view
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=JOIN_TIMEOUT)
        dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank, world_size=world,
                                timeout=JOIN_TIMEOUT)
        ranks = process_group(config.shard, "cuda" if gpu else "cpu")
        trainer = GRPOTrainer(model_path, config, ranks=ranks, **trainer_kwargs)
        conn.send(("ok", None))
    except Exception as e:  # noqa: BLE001 - told to the run, which stops
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:  # the run's process is gone
                return
            if command == "stop":
                return
            try:
                answer = ("ok", getattr(trainer, command)(*args))
            except Exception as e:  # noqa: BLE001 - told to the run, which stops
                answer = ("error", str(e) if isinstance(e, RunError) else f"{type(e).__name__}: {e}")
            try:
                conn.send(answer)
            except OSError:  # the run stopped meanwhile (another rank died): nobody to tell
                return
    finally:
        dist.destroy_process_group()


def one_or_more_processes(model_path: str, config: TrainConfig, stack: ExitStack, *,
                          devices: Sequence[str] | None = None, **trainer_kwargs: Any) -> Any:
    """The run's trainer: a GRPOTrainer in this process with train.processes = 1 (the single-process path, as it
    always was), else TrainerProcesses, stopped when `stack` closes. `devices`: each rank's CUDA_VISIBLE_DEVICES
    (a placement's; default rank_devices)."""
    if config.processes == 1:
        from lightning_sdk.train.trainer import GRPOTrainer

        return GRPOTrainer(model_path, config, **trainer_kwargs)
    return stack.enter_context(TrainerProcesses(model_path, config, devices=devices, **trainer_kwargs))
