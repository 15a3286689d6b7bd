"""The table a run prints when it ends: the reward per iteration, the untrained and trained eval around it."""

from __future__ import annotations

from typing import Any, Callable

from rich.table import Table

from lightning_sdk import metric_names as names
from lightning_sdk.evals import EvalScore

GAP_MEANING = ("logprob gap: mean |trainer - server| log-prob per sampled token before the update (near 0: the "
               "trainer scores what the server sampled)")
# Pipelined, a call may have been sampled by an adapter updates older than the one the trainer starts from: the
# gap then holds the policy's change over that staleness, not only a trainer/server mismatch.
PIPELINED_GAP_MEANING = ("logprob gap: mean |trainer - server| log-prob per sampled token before the update; with "
                         "train.max_staleness > 0 it includes how far the policy moved since each call was sampled "
                         "(staleness), so it is not expected near 0")


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def iteration_table(name: str, history: list[dict[str, Any]], baseline: EvalScore | None,
                    final: EvalScore | None, *, beta: float, pipelined: bool = False) -> Table:
    """One row per iteration, between the eval rows. A column that the run's settings keep at zero (kl when
    train.beta is 0) is left out: a column of zeros reads as a result. The title says what the eval scored (the
    training tasks, or held-out ones)."""
    columns: list[tuple[str, Callable[[dict], str]]] = [
        ("iter", lambda r: str(r["iteration"])), ("policy", lambda r: r["policy"]),
        ("reward", lambda r: f"{r[names.REWARD_MEAN]:.3f}"), ("± std", lambda r: f"{r[names.REWARD_STD]:.3f}"),
        ("failed", lambda r: str(r[names.FAILED])), ("transitions", lambda r: str(r[names.TRANSITIONS])),
        ("loss", lambda r: _fmt(r.get(names.train("loss")))), ("kl", lambda r: _fmt(r.get(names.train("kl")))),
        ("logprob gap", lambda r: _fmt(r.get(names.train("logprob_gap")))),
        ("collect s", lambda r: f"{r[names.timing('collect_s')]:.1f}"),
        ("update s", lambda r: f"{r[names.timing('update_s')]:.1f}")]
    if beta == 0:
        columns = [c for c in columns if c[0] != "kl"]
    scored = next((s for s in (baseline, final) if s is not None), None)
    title = f"{name}: reward per iteration\n{PIPELINED_GAP_MEANING if pipelined else GAP_MEANING}"
    if scored is not None:
        title += f"\neval rows: {scored.words}, mean ± standard error over {scored.n} tasks"
    table = Table(title=title)
    for header, _ in columns:
        table.add_column(header, justify="right")
    blank = [""] * (len(columns) - 3)
    if baseline is not None:
        table.add_row("eval", "untrained", str(baseline), *blank, style="dim")
    for row in map(names.current_row, history):  # a run an earlier version wrote reads the same
        table.add_row(*(cell(row) for _, cell in columns))
    if final is not None:
        table.add_row("eval", "trained", str(final), *blank, style="bold green")
    return table
