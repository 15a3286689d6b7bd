"""How one trainer process shares an update with the others (train.processes > 1): its share of the batch's
micro-batches, the gradient summed over every process, and the adapter made the same everywhere.

The loss weights are fixed over the whole batch before it is split (train.grpo.token_weights), so the full-batch
gradient is the SUM of the processes' gradients, not their mean (DDP's): the sum is taken here, by one all-reduce of
the adapter's gradients in a single flat buffer, after every process has accumulated over its own micro-batches.
A process may hold fewer micro-batches than another, or none (it adds zeros); DDP's per-backward hooks would need
every process to run the same number of backward passes. `OneProcess` is the single-process trainer's: no-ops.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch

T = TypeVar("T")


class Ranks(Protocol):
    rank: int
    world: int

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's share of `items` (every process holds the same list)."""

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Each parameter's gradient replaced by its sum over the processes (None counts as zeros)."""

    def sum_counts(self, totals: Counter, same: Sequence[str]) -> Counter:
        """`totals` summed over the processes, but for the keys in `same` (equal everywhere: kept as they are)."""

    def broadcast(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The parameters as process 0 holds them, in every process."""


class OneProcess:
    rank, world = 0, 1

    def share(self, items: Sequence[T]) -> list[T]:
        return list(items)

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        pass

    def sum_counts(self, totals: Counter, same: Sequence[str]) -> Counter:
        return totals

    def broadcast(self, params: Sequence[torch.nn.Parameter]) -> None:
        pass


class ProcessGroup:
    """torch.distributed's default process group, initialised by the caller (train.ranks)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def share(self, items: Sequence[T]) -> list[T]:
        # Every world-th item: the items come sorted by length, so each process gets as many tokens as another.
        return list(items[self.rank::self.world])

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        import torch.distributed as dist

        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p).to(p.dtype)

    def sum_counts(self, totals: Counter, same: Sequence[str]) -> Counter:
        import torch.distributed as dist

        everyone: list[Counter | None] = [None] * self.world
        dist.all_gather_object(everyone, totals)
        out = Counter({k: v for k, v in totals.items() if k in same})
        for counts in everyone:
            out.update({k: v for k, v in counts.items() if k not in same})
        return out

    def broadcast(self, params: Sequence[torch.nn.Parameter]) -> None:
        import torch.distributed as dist

        flat = torch.cat([p.detach().float().reshape(-1) for p in params])
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for p, v in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(v.view_as(p))
