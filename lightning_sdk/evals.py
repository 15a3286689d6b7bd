"""What an eval score says: its mean with its standard error, on which tasks, and how it is made reproducible.

A run scores data.eval before and after training, and `lightning eval` scores any policy. When those tasks are
training tasks (the default run scores its own 100 sums) the score is not a held-out one, and every place that
shows it says "score on the training tasks". Each eval rollout samples with a seed drawn from (run.seed, task id):
the gateway gives it to the rollout's calls that set none, so the same policy scores the same twice. The server
samples a seeded request from a generator of its own, so its neighbours in a batch do not change its draw. What
can still differ: an agent whose rollout makes several calls at once (their seeds follow the order they arrive
in), and float rounding that differs with the batch's shape (a sample moves only if its uniform lands that close
to a boundary: unseen in 2 x 100 evals of the default run, every reply the same).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EVALS_DIR", "EvalScore", "eval_seed", "score_words", "split_of"]

EVALS_DIR = "evals"  # in a run's directory: one store per `lightning eval` of the run, <UTC time>-iter<N>.sqlite

TRAIN, HELD_OUT, MIXED = "train", "held-out", "mixed"  # EvalScore.split: every, no, or some eval task is trained on


def split_of(eval_ids: Iterable[str], train_ids: Iterable[str]) -> tuple[str, int]:
    """Whether the eval tasks are training tasks (by task id: the same file gives the same ids): the split, and
    how many eval tasks are training tasks."""
    train = set(train_ids)
    ids = list(eval_ids)
    seen = sum(i in train for i in ids)
    return (TRAIN if ids and seen == len(ids) else HELD_OUT if seen == 0 else MIXED), seen


@dataclass(frozen=True)
class EvalScore:
    """The mean score over `n` eval tasks, and its standard error (sample std / sqrt(n); None for one task)."""

    mean: float
    stderr: float | None
    n: int
    split: str = HELD_OUT  # TRAIN | HELD_OUT | MIXED
    seen: int = 0  # eval tasks that are training tasks
    failed: int | None = None  # eval rollouts that failed, each scored FAILED_EVAL_SCORE (store.eval_score); None:
    # not known (a resumed run's untrained score, rebuilt from its checkpoint)
    failures: str = ""  # why, in one line (failures.summary)

    @classmethod
    def of(cls, scores: list[float], split: str = HELD_OUT, seen: int = 0, *, failed: int = 0,
           failures: str = "") -> EvalScore:
        # statistics: exact sums, so a finite reward as large as 1e200 gives a finite mean
        n = len(scores)
        stderr = statistics.stdev(scores) / math.sqrt(n) if n > 1 else None
        return cls(float(statistics.mean(scores)), stderr, n, split, seen, failed, failures)

    @property
    def failed_words(self) -> str:
        """What failed, to follow the score in its line ("" when nothing did): a failed rollout scores 0, and a
        score that is mostly failures must not read as the policy's."""
        if not self.failed:
            return ""
        return f"; {self.failed} of {self.n} rollouts FAILED and scored 0: {self.failures}"

    @property
    def words(self) -> str:
        """What the score is, in words: "score on the training tasks", "held-out score", ..."""
        return score_words(self.split, self.seen, self.n)

    def __str__(self) -> str:
        return f"{self.mean:.3f}" + ("" if self.stderr is None else f" ± {self.stderr:.3f}")


def score_words(split: str | None, seen: int | None = None, n: int | None = None) -> str:
    """An eval score's name for its split: how it is called wherever it is shown. "eval" for a score whose split
    is unknown (a run's metrics.jsonl from before eval_split); the mixed count only when it is known."""
    if split == TRAIN:
        return "score on the training tasks"
    if split == MIXED:
        return "score on tasks partly seen in training" + (f" ({seen} of {n})" if seen is not None and n else "")
    return "held-out score" if split == HELD_OUT else "eval"


def eval_seed(run_seed: int, task_id: str) -> int:
    """The sampling seed of an eval rollout of `task_id`: the same in every eval of a run.seed, whatever the batch,
    the order or the policy (the untrained and trained evals draw the same random numbers: their difference is
    less noisy)."""
    digest = hashlib.sha256(f"{run_seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # below 2**63: what the servers' seed field takes


def draw_seed(run_seed: int, draw: int) -> int:
    """The run seed of the `draw`-th of several paired evals (the gate's decisions): both sides of one draw sample
    with the same seeds, and each draw with new ones, so a score selected in one draw is not reused in the next."""
    return eval_seed(run_seed, f"draw:{draw}")
