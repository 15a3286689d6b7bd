"""Which tasks each iteration collects: the same ones again on resume."""

from __future__ import annotations

import random


class TaskFeed:
    """Deterministic batches: epoch e is the dataset shuffled with seed (seed, e), so resume sees the same tasks."""

    def __init__(self, tasks: list[dict], batch: int, *, seed: int, shuffle: bool):
        self.tasks, self.batch, self.seed, self.shuffle = tasks, batch, seed, shuffle

    def batch_for(self, iteration: int) -> list[dict]:
        start = iteration * self.batch
        out = []
        for k in range(start, start + self.batch):
            epoch, pos = divmod(k, len(self.tasks))
            order = list(range(len(self.tasks)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            out.append(self.tasks[order[pos]])
        return out
