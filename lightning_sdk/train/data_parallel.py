"""How one trainer process shares an update with the others (train.processes > 1): its share of the batch's
micro-batches, the gradient summed over every process, and the adapter made the same everywhere.

The loss weights are fixed over the whole batch before it is split (train.grpo.token_weights), so the full-batch
gradient is the SUM of the processes' gradients, not their mean (DDP's): the sum is taken here, by one all-reduce of
the adapter's gradients in a single flat buffer, after every process has accumulated over its own micro-batches.
A process may hold fewer micro-batches than another, or none (it adds zeros); DDP's per-backward hooks would need
every process to run the same number of backward passes. `OneProcess` is the single-process trainer's: no-ops.

`ShardedGroup` (train.shard = "fsdp") holds each parameter of the model, the frozen base's as the adapter's, once
over the processes (torch's FSDP2, `fully_shard`, one group per decoder layer): every forward and backward pass is
then a collective, so every process runs as many micro-batches as the busiest (the others' extra ones weigh 0), and
a checkpoint gathers each adapter tensor whole in every process before process 0 writes it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch

T = TypeVar("T")
M = TypeVar("M", bound=torch.nn.Module)


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

    def load_device(self, device: str) -> str:
        """Where the base model is read to before `shard` (the trainer's device, unless sharding moves it)."""

    def shard(self, model: M) -> M:
        """The model as this process trains it: itself, or its parameters sharded over the processes."""

    def lockstep(self, n: int) -> int:
        """How many micro-batches this process runs when it holds `n`: more (each weighing 0) where every pass is
        a collective that all the processes take part in."""

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """`t` entire, detached (a sharded tensor gathered: every process calls this, in the same order)."""

    def part(self, like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`value` (entire) as `like` holds it: this process's shard of it where `like` is sharded."""

    def held(self, t: torch.Tensor) -> int:
        """How many of `t`'s elements this process holds."""


class Whole:
    """Every process holds the whole model (the one-process trainer, and data parallelism without sharding)."""

    def load_device(self, device: str) -> str:
        return device

    def shard(self, model: M) -> M:
        return model

    def lockstep(self, n: int) -> int:
        return n

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def part(self, like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value

    def held(self, t: torch.Tensor) -> int:
        return t.numel()


class OneProcess(Whole):
    rank, world = 0, 1

    def share(self, items: Sequence[T]) -> list[T]:
        return list(items)

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        pass

    def sum_counts(self, totals: Counter, same: Sequence[str]) -> Counter:
        return totals

    def broadcast(self, params: Sequence[torch.nn.Parameter]) -> None:
        pass


class ProcessGroup(Whole):
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


class ShardedGroup(ProcessGroup):
    """The default process group, the model's parameters sharded over it (FSDP2). `device_type`: 'cpu' (gloo) or
    'cuda' (NCCL, one GPU per process)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def load_device(self, device: str) -> str:
        # The whole base is read into host memory; `fully_shard` then moves each process's shard of each layer
        # to its device, one layer at a time, so no device ever holds the whole base.
        return "cpu"

    def shard(self, model: M) -> M:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = init_device_mesh(self.device_type, (self.world,))
        # The decoder layers: the ModuleList holding most of the weights, whatever the family names it. One group
        # each (all-gathered for its own forward, then freed); the embeddings, norm and head in the root's group.
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        if lists:
            for layer in max(lists, key=lambda m: sum(p.numel() for p in m.parameters())):
                fully_shard(layer, mesh=mesh)
        # The root's group freed after its forward too (FSDP keeps it whole by default): between passes every
        # parameter the model holds is its shard, the one peft's disable_adapter (the reference pass) flips
        # requires_grad on, and the one FSDP reads that flag from.
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                # The reduce-scatter sums, with SUM itself (gloo has neither AVG nor a pre-scaled sum): each
                # process's gradient is its share of the batch's (see above).
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        return model

    def lockstep(self, n: int) -> int:
        import torch.distributed as dist

        most = torch.tensor([n])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        pass  # each backward pass reduce-scattered its gradients, summed (shard): each process holds its shard's sum

    def broadcast(self, params: Sequence[torch.nn.Parameter]) -> None:
        pass  # each value is held once, by the process whose shard it is: nothing can differ between processes

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()

    def part(self, like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(like, DTensor):
            return value
        # Every process holds the same `value` (read from the same checkpoint): each keeps its shard, no message.
        return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)

    def held(self, t: torch.Tensor) -> int:
        from torch.distributed.tensor import DTensor

        return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def process_group(shard: str, device_type: str) -> Ranks:
    """The data-parallel process's Ranks for train.shard ('none' or 'fsdp'): the one place that reads it."""
    return ShardedGroup(device_type) if shard == "fsdp" else ProcessGroup()
