"""`lightning check`: the pre-flight. The user's agent runs once, N tasks x group_size rollouts, through the run's own
gateway and inference server; nothing is trained and nothing is written into run.dir. Per rollout it shows what the
trainer would get from it, per group the reward variance, then one verdict: what would train, or why nothing would
and what to change.
"""

from __future__ import annotations

import re
import statistics
import sys
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import lightning_sdk
from lightning_sdk import data, tracing
from lightning_sdk.config import Config
from lightning_sdk.rollouts.job import RolloutJob
from lightning_sdk.runtime import Runtime, TaskFeed, policy_failure
from lightning_sdk.tracing.records import is_llm_call
from lightning_sdk.transitions import to_transitions

__all__ = ["RolloutCheck", "Verdict", "check", "verdict"]

# Why a call cannot train, and what to change; "setting:<name>" is handled apart (any name).
FIXES = {
    "greedy": ("the agent's LLM calls are greedy (temperature 0): an argmax is not a sample of the policy",
               "sample in its training calls: temperature > 0, e.g. 1.0"),
    "n>1": ("the agent's LLM calls ask for several choices (n > 1): which one it acted on is unknown",
            "make one call per sample (n = 1)"),
    "failed_call": ("every LLM call failed", "see the error in the table; a prompt over the context needs a shorter "
                    "prompt, fewer max_tokens or a larger serve.max_model_len"),
    "bad_token_ids": ("the server returned no usable token ids for the calls",
                      "serve with the built-in server or vLLM >= 0.10.2 (they return token ids)"),
}
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')


@dataclass(frozen=True)
class RolloutCheck:
    """What one rollout would give the trainer."""

    rollout_id: str
    group_id: str
    status: str  # 'succeeded' | 'failed'
    reward: float | None  # the outcome it would train with (rollout.failed_reward for a penalised failure)
    error: str | None
    where: str | None  # the line of the user's code that raised, "agent.py:12 in score: return 1 / 0"
    calls: int  # LLM calls the gateway attributed to it
    left_out: Counter  # its calls (and rewards) left out of training, by reason (transitions.to_transitions)
    components: tuple[str, ...]  # the components its calls named
    call_error: str | None  # the first failed call's error
    transitions: int


@dataclass(frozen=True)
class Verdict:
    trains: bool
    line: str


def check(cfg: Config, *, tasks: int, console: Console) -> Verdict:
    """Run `tasks` tasks (the first iteration's) x data.group_size rollouts once, print the table and the verdict.

    Bad input raises as `lightning run` would (SetupError, DatasetError, ModelLoadError) before the server starts."""
    runtime = Runtime(cfg, console=console)
    batch = TaskFeed(data.load(cfg.data.train, cfg.data.required_fields), tasks, seed=cfg.run.seed,
                     shuffle=cfg.data.shuffle).batch_for(0)
    rollouts, unattributed = _collect(runtime, batch)
    console.print(_table(rollouts, cfg))
    v = verdict(rollouts, unattributed, cfg.rollout.components)
    console.print(f"[bold {'green' if v.trains else 'red'}]{escape(v.line)}[/]", highlight=False, soft_wrap=True)
    return v


def _collect(runtime: Runtime, tasks: list[dict]) -> tuple[list[RolloutCheck], int]:
    cfg = runtime.cfg
    jobs = [RolloutJob(rollout_id=f"check-{i:03d}-{g}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                       group_id=f"task {i + 1}", task=t, iteration=1)
            for i, t in enumerate(tasks) for g in range(cfg.data.group_size)]
    out = []
    with runtime.scratch_session(tasks) as (collector, store):
        policy = collector.server.served_model_name
        collector.gateway.policy = policy
        results = collector.collect(jobs, policy, label=f"check: {len(jobs)} rollouts")
        capture = collector.gateway.capture
        capture.flush()
        tracing.flush()
        for r in results:
            record, spans = store.rollout(r.job.rollout_id), store.spans(r.job.rollout_id)
            calls = [s for s in spans if is_llm_call(s)]
            penalised = r.status == "failed" and cfg.rollout.failed_reward is not None and policy_failure(r)
            reward = record.reward if r.status == "succeeded" else cfg.rollout.failed_reward if penalised else None
            left: Counter = Counter()
            n, error = 0, record.error
            if reward is not None:
                try:
                    n = len(to_transitions(record, spans, credit=runtime.credit_rule,
                                           components=cfg.rollout.components, error_reward=cfg.rollout.error_reward,
                                           failed_reward=cfg.rollout.failed_reward if penalised else None,
                                           skipped=left))
                except ValueError as e:  # e.g. a credit rule of the user's that returned bad weights
                    error = f"rollout.credit: {e}"
            failed_calls = [c for c in calls if c.is_error]
            out.append(RolloutCheck(
                rollout_id=record.rollout_id, group_id=record.group_id, status=record.status, reward=reward,
                error=error, where=user_line(record.traceback), calls=len(calls), left_out=left,
                components=tuple(sorted({c.component for c in calls if c.component})),
                call_error=(failed_calls[0].status_message or "failed") if failed_calls else None, transitions=n))
        unattributed = capture.unattributed
    return out, unattributed


def verdict(rollouts: list[RolloutCheck], unattributed: int, components: list[str]) -> Verdict:
    """'would train: N transitions from M groups', or 'would train nothing, because ...' with the fix."""
    groups: dict[str, list[RolloutCheck]] = defaultdict(list)
    for r in rollouts:
        groups[r.group_id].append(r)
    rewards = {g: [r.reward for r in rs if r.reward is not None] for g, rs in groups.items()}
    signal = {g for g, x in rewards.items() if len(x) > 1 and max(x) != min(x)}
    trained = {g: sum(r.transitions for r in groups[g]) for g in signal}
    n = sum(trained.values())
    if n:
        quiet = len(groups) - sum(1 for v in trained.values() if v)
        note = f"; {quiet} of {len(groups)} groups give no signal (see the table)" if quiet else ""
        return Verdict(True, f"would train: {n} transitions from {sum(1 for v in trained.values() if v)} groups{note}")
    scored = [r for r in rollouts if r.reward is not None]
    if not scored:
        first = next((r for r in rollouts if r.error), None)
        where = f" at {first.where}" if first and first.where else ""
        return _nothing(f"every rollout failed (first: {first.error if first else 'no error recorded'}{where})",
                        "fix the agent or its @reward where it raised")
    if not any(r.calls for r in scored):
        why = "no rollout made an LLM call the gateway could attribute to it"
        if unattributed:
            why += (f" (the gateway served {unattributed} call(s) of no rollout: a client that sends no W3C "
                    f"traceparent, or a call outside the rollout)")
        return _nothing(why, "call the run's server (OPENAI_BASE_URL, or the `llm` argument's base_url) inside the "
                             "@rollout function; docs/remote.md has the per-rollout base URL for other clients")
    if not any(r.transitions for r in scored):
        reasons: Counter = Counter()
        for r in scored:
            reasons.update({k: v for k, v in r.left_out.items() if k not in ("no_llm_call", "unassigned_reward",
                                                                                 "bad_reward")})
        top = reasons.most_common(1)[0][0] if reasons else "failed_call"
        if top == "other_component":
            seen = sorted({c for r in scored for c in r.components})
            return _nothing(f"none of the LLM calls is of rollout.components = {components} (their components: "
                            f"{seen or 'none named'})", "set rollout.components to the component(s) to train, or "
                            "leave it empty to train every call")
        if top.startswith("setting:"):
            name = top.partition(":")[2]
            return _nothing(f"the agent's LLM calls set {name}, which the trainer cannot reproduce",
                            f"leave {name} out of the agent's calls while it trains")
        why, fix = FIXES.get(top, FIXES["failed_call"])
        if top == "failed_call":
            first = next((r.call_error for r in scored if r.call_error), None)
            why += f" (first: {first})" if first else ""
        return _nothing(why, fix)
    if all(len(x) < 2 for x in rewards.values()):
        return _nothing("no group has two scored rollouts (the others failed)", "fix the failures in the table")
    values = sorted({v for x in rewards.values() for v in x})
    return _nothing(f"every group's rewards are equal ({', '.join(f'{v:g}' for v in values[:4])}): GRPO learns "
                    f"from differences within a group", "a reward that tells better outputs from worse (partial "
                    "credit), tasks the model solves only sometimes, or a larger data.group_size")


def _nothing(why: str, fix: str) -> Verdict:
    return Verdict(False, f"would train nothing, because {why}. Fix: {fix}.")


def user_line(traceback: str | None) -> str | None:
    """The innermost frame of a stored traceback in the user's own code (not this package, not an installed library
    or the standard library), as 'file.py:12 in fn: the line'."""
    if not traceback:
        return None
    lines = traceback.splitlines()
    ours = str(Path(lightning_sdk.__file__).parent)
    library = (ours, sys.prefix, sys.base_prefix, "<frozen")
    found = None
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m and not m["file"].startswith(library) and "site-packages" not in m["file"]:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            found = f"{Path(m['file']).name}:{m['line']} in {m['fn']}" + (f": {code}" if code else "")
    return found


def _table(rollouts: list[RolloutCheck], cfg: Config) -> Table:
    components = f" (rollout.components = {cfg.rollout.components})" if cfg.rollout.components else ""
    agent = cfg.agent.module if cfg.agent else "the workers' agent"
    table = Table(title=f"lightning check: {len(rollouts)} rollouts of {agent}{components}, nothing trained",
                  title_justify="left")
    for col, justify in (("group", "left"), ("reward var", "right"), ("rollout", "left"), ("reward", "right"),
                         ("LLM calls", "right"), ("cannot train", "left"), ("transitions", "right"),
                         ("error", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    groups: dict[str, list[RolloutCheck]] = defaultdict(list)
    for r in rollouts:
        groups[r.group_id].append(r)
    for g, rs in groups.items():
        x = [r.reward for r in rs if r.reward is not None]
        var = f"{statistics.pvariance(x):.3g}" if len(x) > 1 else "-"
        for k, r in enumerate(rs):
            left = ", ".join(f"{n} {reason}" for reason, n in sorted(r.left_out.items()) if n)
            error = r.error or ""
            if r.where:
                error += f" ({r.where})"
            if r.call_error and "failed_call" in r.left_out:
                error += ("; " if error else "") + f"call: {r.call_error}"
            table.add_row(g if k == 0 else "", (var + (" (no signal)" if var == "0" else "")) if k == 0 else "",
                          r.rollout_id.rsplit("-", 1)[0], "failed" if r.reward is None else f"{r.reward:g}",
                          str(r.calls), escape(left), str(r.transitions), escape(error[:160]),
                          end_section=k == len(rs) - 1)
    return table
