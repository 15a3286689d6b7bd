"""`lightning check`: the pre-flight. The user's agent runs once, N tasks x group_size rollouts, through the run's own
gateway and inference server; nothing is trained and nothing is written into run.dir. Per rollout it shows what the
trainer would get from it, per group the reward variance, then one verdict: what would train, or why nothing would
and what to change.
"""

from __future__ import annotations

import statistics
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lightning_sdk import data, tracing
from lightning_sdk.config import Config
from lightning_sdk.constraint import Constraint
from lightning_sdk.failures import cannot_train, first_line, fix_for_failure, summary, user_line
from lightning_sdk.rollouts.job import RolloutJob
from lightning_sdk.runtime import Runtime, TaskFeed, policy_failure
from lightning_sdk.runtime.preflight import say_memory
from lightning_sdk.tracing.records import AGENT, CONSTRAINT, REWARD_NAME, REWARD_SPAN, REWARD_VALUE, is_llm_call
from lightning_sdk.transitions import to_transitions

__all__ = ["EXIT_FAILED", "EXIT_NOTHING", "EXIT_TRAINS", "RolloutCheck", "Verdict", "check", "user_line", "verdict"]

EXIT_TRAINS, EXIT_NOTHING, EXIT_FAILED = 0, 1, 3  # `lightning check`'s exit status: would train cleanly / train
# nothing / train, but some rollouts failed (a failure the run would skip and count, not train on)
_TOOL_OP = "execute_tool"  # gen_ai.operation.name of a tool span (OpenTelemetry's gen_ai conventions)


@dataclass(frozen=True)
class RolloutCheck:
    """What one rollout would give the trainer."""

    rollout_id: str
    group_id: str
    task_id: str
    status: str  # 'succeeded' | 'failed'
    reward: float | None  # the outcome it would train with (rollout.failed_reward for a penalised failure)
    error: str | None
    where: str | None  # the line of the user's code that raised, "agent.py:12 in score: return 1 / 0"
    calls: int  # LLM calls the gateway attributed to it
    left_out: Counter  # its calls (and rewards) left out of training, by reason (transitions.to_transitions)
    components: tuple[str, ...]  # the components its calls named
    call_error: str | None  # the first failed call's error
    transitions: int
    traceback: str | None = None
    emitted: tuple[str, ...] = ()  # its emit_reward values, "name=value"
    tools: int = 0  # its tool spans (gen_ai.operation.name = execute_tool)
    constrained: tuple[str, ...] = ()  # each constrained call's constraint, named (Constraint.label)


@dataclass(frozen=True)
class Verdict:
    trains: bool
    line: str
    failed: int = 0  # rollouts that failed (and are not trained at rollout.failed_reward)

    @property
    def exit_code(self) -> int:
        return EXIT_NOTHING if not self.trains else EXIT_FAILED if self.failed else EXIT_TRAINS


def check(cfg: Config, *, tasks: int, console: Console) -> Verdict:
    """Run `tasks` tasks (the first iteration's) x data.group_size rollouts once, print the table and the verdict.

    Bad input raises as `lightning run` would (SetupError, DatasetError, ModelLoadError) before the server starts."""
    runtime = Runtime(cfg, console=console)
    batch = TaskFeed(data.load(cfg.data.train, cfg.data.required_fields), tasks, seed=cfg.run.seed,
                     shuffle=cfg.data.shuffle).batch_for(0)
    say_memory(cfg, console)  # before the server starts: a model that will not fit is said before it loads
    rollouts, unattributed, alone = _collect(runtime, batch)
    console.print(rollout_table(rollouts, cfg))
    v = verdict(rollouts, unattributed, cfg.rollout.components)
    if alone is not None:
        v = _thread_unsafe(v, alone, cfg.rollout.concurrency)
    colour = "green" if v.exit_code == EXIT_TRAINS else "yellow" if v.trains else "red"
    console.print(f"[bold {colour}]{escape(v.line)}[/]", highlight=False, soft_wrap=True)
    return v


def _thread_unsafe(v: Verdict, alone: tuple[int, int], concurrency: int) -> Verdict:
    """The verdict when failed rollouts were run again one at a time: mostly succeeding then, the agent is not safe
    to run in threads (rollouts of one process share its module-level objects)."""
    ok, n = alone
    if not n or ok * 2 < n:
        return v
    said = v.line.split(". Fix: ")[0].rstrip(".")  # its fix was for a fault of the agent's own code
    return Verdict(v.trains, f"{said}. {ok} of {n} failed rollouts succeeded when run again one at a "
                   f"time: the agent is not safe to run in threads at rollout.concurrency = {concurrency} (its "
                   f"rollouts share objects built at import, e.g. an agent object). Fix: run.runtime = "
                   f"\"processes\" (each rollout in a worker process, rollout.concurrency of them), or build the "
                   f"agent inside the @rollout function.", v.failed)


def _collect(runtime: Runtime, tasks: list[dict]) -> tuple[list[RolloutCheck], int, tuple[int, int] | None]:
    """Each task x group_size rollouts, what each would give the trainer, the calls of no rollout, and, when some
    failed at rollout.concurrency > 1 in threads, how many of them (ok, run) succeed when run one at a time."""
    cfg = runtime.cfg
    jobs = [RolloutJob(rollout_id=f"check-{i:03d}-{g}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                       group_id=f"task {data.task_id(t)}", task=t, iteration=1)
            for i, t in enumerate(tasks) for g in range(cfg.data.group_size)]
    out = []
    alone = None
    with runtime.scratch_session(tasks) as (collector, store):
        policy = collector.server.served_model_name
        collector.gateway.policy = policy
        results = collector.collect(jobs, policy, label=f"check: {len(jobs)} rollouts")
        failed = [r.job for r in results if r.status == "failed" and r.failed_in == "rollout"]
        if failed and cfg.rollout.concurrency > 1 and cfg.run.runtime == "embedded":
            again = [RolloutJob(rollout_id=f"check-alone-{k:03d}-{uuid.uuid4().hex[:8]}", task_id=j.task_id,
                                group_id="alone", task=j.task, iteration=1) for k, j in enumerate(failed[:8])]
            concurrency = cfg.rollout.concurrency
            cfg.rollout.concurrency = 1
            try:
                rerun = collector.collect(again, policy, label=f"check: {len(again)} failed rollouts, one at a time")
            finally:
                cfg.rollout.concurrency = concurrency
            alone = (sum(r.status == "succeeded" for r in rerun), len(rerun))
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
            emitted = tuple(f"{s.attributes.get(REWARD_NAME)}={s.attributes.get(REWARD_VALUE):g}" for s in spans
                            if s.name == REWARD_SPAN and isinstance(s.attributes.get(REWARD_VALUE), (int, float)))
            tools = sum(1 for s in spans if s.source == AGENT and (s.attributes.get("gen_ai.operation.name") ==
                                                                   _TOOL_OP or s.name.startswith(_TOOL_OP)))
            out.append(RolloutCheck(
                rollout_id=record.rollout_id, group_id=record.group_id, task_id=record.task_id,
                status=record.status, reward=reward, error=error, where=user_line(record.traceback), calls=len(calls),
                left_out=left, components=tuple(sorted({c.component for c in calls if c.component})),
                call_error=(failed_calls[0].status_message or "failed") if failed_calls else None, transitions=n,
                traceback=record.traceback, emitted=emitted, tools=tools,
                constrained=tuple(Constraint.from_json(c.attributes[CONSTRAINT]).label for c in calls
                                  if isinstance(c.attributes.get(CONSTRAINT), str))))
        unattributed = capture.unattributed
    return out, unattributed, alone


def verdict(rollouts: list[RolloutCheck], unattributed: int, components: list[str]) -> Verdict:
    """'would train: N transitions from M groups', or 'would train nothing, because ...' with the fix."""
    groups: dict[str, list[RolloutCheck]] = defaultdict(list)
    for r in rollouts:
        groups[r.group_id].append(r)
    rewards = {g: [r.reward for r in rs if r.reward is not None] for g, rs in groups.items()}
    signal = {g for g, x in rewards.items() if len(x) > 1 and max(x) != min(x)}
    trained = {g: sum(r.transitions for r in groups[g]) for g in signal}
    n = sum(trained.values())
    failed = [r for r in rollouts if r.reward is None]
    failed_words = (f"; {len(failed)} of {len(rollouts)} rollouts FAILED "
                    f"({summary((r.error, r.traceback) for r in failed)})" if failed else "")
    failures = (f"{failed_words} and would be skipped. Fix: {fix_for_failure(failed[0].error, failed[0].where)}"
                if failed else "")
    if n:
        quiet = len(groups) - sum(1 for v in trained.values() if v)
        note = f"; {quiet} of {len(groups)} groups give no signal (see the table)" if quiet else ""
        return Verdict(True, f"would train: {n} transitions from {sum(1 for v in trained.values() if v)} groups"
                             f"{note}{failures}", len(failed))
    scored = [r for r in rollouts if r.reward is not None]
    if not scored:
        return _nothing(f"every rollout failed ({summary((r.error, r.traceback) for r in rollouts)})",
                        fix_for_failure(rollouts[0].error if rollouts else None, rollouts[0].where if rollouts else None),
                        len(failed))
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
            reasons.update(r.left_out)
        why, fix = cannot_train(reasons, components, sorted({c for r in scored for c in r.components}),
                                next((r.call_error for r in scored if r.call_error), None))
        return _nothing(why, fix, len(failed))
    if all(len(x) < 2 for x in rewards.values()):
        return _nothing(f"no group has two scored rollouts{failed_words}",
                        fix_for_failure(failed[0].error, failed[0].where) if failed else "fix the failures in the table",
                        len(failed))
    values = sorted({v for x in rewards.values() for v in x})
    return _nothing(f"every group's rewards are equal ({', '.join(f'{v:g}' for v in values[:4])}): GRPO learns "
                    f"from differences within a group", "a reward that tells better outputs from worse (partial "
                    "credit), tasks the model solves only sometimes, or a larger data.group_size", len(failed))


def _nothing(why: str, fix: str, failed: int = 0) -> Verdict:
    return Verdict(False, f"would train nothing, because {why}. Fix: {fix}.", failed)


def rollout_table(rollouts: list[RolloutCheck], cfg: Config) -> Table:
    components = f" (rollout.components = {cfg.rollout.components})" if cfg.rollout.components else ""
    agent = cfg.agent.module if cfg.agent else "the workers' agent"
    table = Table(title=f"lightning check: {len(rollouts)} rollouts of {agent}{components}, nothing trained",
                  title_justify="left")
    for col, justify in (("task", "left"), ("reward var", "right"), ("rollout", "left"), ("reward", "right"),
                         ("LLM calls", "right"), ("components", "left"), ("emit_reward", "left"),
                         ("tool spans", "right"), ("cannot train", "left"), ("transitions", "right"),
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
            error = first_line(r.error or "", 160)
            if r.where:
                error += f" ({r.where})"
            if r.call_error and "failed_call" in r.left_out:
                error += ("; " if error else "") + f"call: {first_line(r.call_error, 120)}"
            table.add_row(escape(r.task_id) if k == 0 else "",
                          (var + (" (no signal)" if var == "0" else "")) if k == 0 else "",
                          r.rollout_id.rsplit("-", 1)[0], "failed" if r.reward is None else f"{r.reward:g}",
                          str(r.calls) + (f" ({len(r.constrained)} constrained: "
                                           f"{escape(', '.join(sorted(set(r.constrained))))})" if r.constrained else ""),
                          escape(", ".join(r.components)), escape(", ".join(r.emitted)),
                          str(r.tools), escape(left), str(r.transitions), escape(error),
                          end_section=k == len(rs) - 1)
    return table
