"""Calls of a rollout that extend one another, packed into one sequence the trainer reads once.

An agent's next call usually sends the previous call's prompt, its completion and the tool's output: call k+1's
prompt token ids start with call k's prompt + completion ids. Trained as separate rows, the update reads that shared
history once per call. With causal attention the log-prob of a completion token depends only on the tokens before
it, so the calls can be one row: the first call's prompt, then each call's completion (trained with its own
advantage, temperature, top-p, sampler log-probs and grammar mask) followed by what the next prompt added (the
observation: read, never trained). The token ids are the gateway's exact ones, so "extends" is an exact prefix test,
never a guess; calls that do not extend one another stay rows of their own, as before.

Rows whose prompts are the same token for token (the rollouts of one group start from the same task) then share
it: one sequence holds the prompt once and each row's tail after it as a branch that attends to the prompt and to
itself only (a mask per row, train.microbatch; positions restart after the prompt in every branch), so each token
still sees exactly what it saw in its own row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_sdk.transitions import Transition


@dataclass(frozen=True)
class Segment:
    """One call's completion inside a row: which transition, and where its tokens sit in the row's tail."""

    index: int  # into the transitions the row was packed from
    start: int  # offset of its first completion token in Row.tail
    length: int


@dataclass(frozen=True)
class Row:
    """One sequence of a micro-batch: `prompt_ids` are context only, `tail` holds the completions (`segments`) and
    the observations between them (not trained). `branches`: where each branch starts in the tail; a branch sees the
    prompt and its own tokens, not the branches before it."""

    prompt_ids: tuple[int, ...]
    tail: tuple[int, ...]
    segments: tuple[Segment, ...]
    branches: tuple[int, ...] = (0,)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tail)


def single(ts: Sequence[Transition], i: int) -> Row:
    """Transition `i` as a row of its own."""
    t = ts[i]
    return Row(t.prompt_ids, t.completion_ids, (Segment(i, 0, len(t.completion_ids)),))


def extends(later: Transition, earlier: Transition) -> bool:
    """Whether `later`'s prompt starts with `earlier`'s prompt + completion, token for token."""
    p, c = len(earlier.prompt_ids), len(earlier.completion_ids)
    return (len(later.prompt_ids) >= p + c and later.prompt_ids[:p] == earlier.prompt_ids
            and later.prompt_ids[p:p + c] == earlier.completion_ids)


def pack(ts: Sequence[Transition], trained: Sequence[bool]) -> list[Row]:
    """Rows for the transitions with `trained` tokens: each chain of calls of one rollout and one policy (adapter)
    in which every call extends the one before becomes one row; any other call is a row of its own.

    A call without trained tokens (cut by max_tokens under train.mask_truncated) still links a chain, its tokens
    read as context: the next call's prompt holds them anyway. Rows end at their last trained call; a chain with
    none gives no row.
    """
    chains: list[list[int]] = []
    open_by_key: dict[tuple[str, str | None], list[list[int]]] = {}
    for i in sorted(range(len(ts)), key=lambda i: (ts[i].rollout_id, ts[i].index)):
        t = ts[i]
        mine = open_by_key.setdefault((t.rollout_id, t.policy), [])
        chain = next((c for c in mine if extends(t, ts[c[-1]])), None)
        if chain is None:
            chain = [i]
            mine.append(chain)
            chains.append(chain)
        else:
            chain.append(i)
    rows = []
    for chain in chains:
        while chain and not trained[chain[-1]]:
            chain.pop()
        if chain:
            rows.append(_row(ts, chain))
    return rows


def _row(ts: Sequence[Transition], chain: list[int]) -> Row:
    if len(chain) == 1:
        return single(ts, chain[0])
    first = ts[chain[0]]
    base = len(first.prompt_ids)
    segments = []
    for i in chain:
        t = ts[i]
        segments.append(Segment(i, len(t.prompt_ids) - base, len(t.completion_ids)))
    last = ts[chain[-1]]
    return Row(first.prompt_ids, last.prompt_ids[base:] + last.completion_ids, tuple(segments))


def share(rows: Sequence[Row], ts: Sequence[Transition], max_branches: int) -> list[Row]:
    """`rows` whose prompts are equal, token for token, and whose calls one policy (adapter) served, merged into
    rows of at most `max_branches` branches: the prompt once, each row's tail a branch of its own (in the order
    given). A packed row is as long as its last call, so a merged row is at most `max_branches` calls long."""
    by_prompt: dict[tuple[tuple[int, ...], str | None], list[Row]] = {}
    for row in rows:
        by_prompt.setdefault((row.prompt_ids, ts[row.segments[0].index].policy), []).append(row)
    out = []
    for same in by_prompt.values():
        for k in range(0, len(same), max_branches):
            out.append(_merged(same[k:k + max_branches]))
    return out


def _merged(same: Sequence[Row]) -> Row:
    if len(same) == 1:
        return same[0]
    tail: tuple[int, ...] = ()
    segments, branches = [], []
    for row in same:
        branches += [len(tail) + b for b in row.branches]
        segments += [Segment(s.index, len(tail) + s.start, s.length) for s in row.segments]
        tail += row.tail
    return Row(same[0].prompt_ids, tail, tuple(segments), tuple(branches))
