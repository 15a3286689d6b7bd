"""One iteration's collection, from its jobs to the batch its update trains on, and the row it leaves in
metrics.jsonl: which rollouts count, which are penalised, and why a batch has nothing to train."""

from __future__ import annotations

import statistics
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_sdk import data, tracing
from lightning_sdk import metric_names as names
from lightning_sdk.errors import CaptureError, RunError
from lightning_sdk.failures import cannot_train
from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
from lightning_sdk.runtime.session import Session
from lightning_sdk.transitions import Transition, to_transitions

if TYPE_CHECKING:  # torch comes with the trainer, imported when a run starts
    from lightning_sdk.train.grpo import GroupOutcomes


@dataclass
class Batch:
    """One iteration's collection, ready for its update."""

    n: int  # the iteration, from 1
    label: str  # the adapters it was collected from (when it began)
    results: list[RolloutResult]
    ok: list[RolloutResult]  # the succeeded rollouts
    transitions: list[Transition]
    scored: GroupOutcomes  # every scored rollout's outcome per group: the baselines
    skipped: Counter[str]  # calls, rollouts and rewards left out, by reason
    penalised: int  # failed rollouts trained at rollout.failed_reward
    collect_s: float
    base_calls: int  # with [policies]: calls of components in no policy, served by the base model
    failures: str = ""  # its failed rollouts in one line (failures.summary), "" when none failed
    extra: dict[str, float] = field(default_factory=dict)  # more of its update's numbers (pipelined: the staleness)

    @property
    def reward_mean(self) -> float:
        # statistics: exact sums, so a finite reward as large as 1e200 gives a finite mean, not an OverflowError
        return float(statistics.mean(r.reward for r in self.ok))

    def row(self, train_metrics: dict[str, float], update_s: float, handover: dict[str, float]) -> dict:
        """Its row of metrics.jsonl (names: metric_names), as far as the update: the hot-load and elapsed times
        come after. `handover`: the server's sleep_s and wake_s."""
        results, transitions = self.results, self.transitions
        return {
            names.ITERATION: self.n, "policy": self.label, names.REWARD_MEAN: self.reward_mean,
            names.REWARD_STD: statistics.pstdev([r.reward for r in self.ok]),
            names.ROLLOUTS: len(results), names.FAILED: len(results) - len(self.ok),
            names.TRANSITIONS: len(transitions),
            names.COMPLETION_TOKENS: sum(len(t.completion_ids) for t in transitions),
            names.FAILED_TRAINED: self.penalised,
            **{names.skipped(k): v for k, v in sorted(self.skipped.items()) if v},
            names.timing("collect_s"): self.collect_s, names.timing("update_s"): update_s,
            **{names.timing(k): v for k, v in handover.items()},
            **{names.train(k): v for k, v in {**train_metrics, **self.extra}.items()},
        }


def collect_batch(session: Session, n: int, tasks: list[dict], policy: dict[str, str] | None) -> Batch:
    """Iteration n's rollouts collected under `policy` (None: as the gateway routes now), and their transitions."""
    cfg, gateway = session.cfg, session.collector.gateway
    jobs = [RolloutJob(rollout_id=f"it{n:04d}-{i:03d}-{g}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                       group_id=f"{n}:{i}", task=t, iteration=n)
            for i, t in enumerate(tasks) for g in range(cfg.data.group_size)]
    t0 = time.perf_counter()
    base_calls = sum(gateway.base_served.values())
    label = session.label(policy if policy is not None else session.routed())
    results = session.collect(jobs, policy, f"iteration {n}/{cfg.run.iterations} collect")
    collect_s = time.perf_counter() - t0
    ok = [r for r in results if r.status == "succeeded"]
    failed = len(results) - len(ok)
    failures = session.failures(results)
    if len(ok) < len(results) / 2:
        raise RunError(f"iteration {n}: {failed} of {len(results)} rollouts failed ({failures}); not training on "
                       f"the rest. See `lightning traces --run-dir {cfg.run.dir} --status failed`.")
    skipped: Counter[str] = Counter()
    penalised = [r for r in results if policy_failure(r)] if cfg.rollout.failed_reward is not None else []
    transitions, scored = transitions_of(session, ok, skipped, penalised)
    return Batch(n, label, results, ok, transitions, scored, skipped, len(penalised), collect_s,
                 sum(gateway.base_served.values()) - base_calls, failures)


def transitions_of(session: Session, ok: list[RolloutResult], skipped: Counter,
                   penalised: list[RolloutResult] = ()) -> tuple[list[Transition], GroupOutcomes]:
    """Transitions of the succeeded rollouts, and of the failed ones trained at rollout.failed_reward, and the
    outcome of each of those rollouts per group, whether it left a transition or not (the group baselines);
    `skipped` counts the LLM calls, rollouts and rewards left out, by reason (transitions.to_transitions)."""
    cfg, store, console = session.cfg, session.store, session.console
    capture = session.collector.gateway.capture
    if not capture.flush():
        raise RunError("the gateway's call records did not reach the store within 30 s")
    tracing.flush()
    errors = capture.errors + tracing.writer_errors()
    if errors:
        raise RunError(f"writing call records or spans failed, some may be missing: {errors[0]}")
    if store.span_conflicts:
        console.print(f"[yellow]{store.span_conflicts} span(s) refused so far: their ids were taken by spans "
                      f"already stored (those are kept); see the log")
    components = session.trained_components()
    out: list[Transition] = []
    scored: dict[str, dict[str, float]] = defaultdict(dict)
    for r in [*ok, *penalised]:
        record = store.rollout(r.job.rollout_id)
        failed_reward = cfg.rollout.failed_reward if r.status == "failed" else None
        out += to_transitions(record, store.spans(r.job.rollout_id), credit=session.credit_rule,
                              components=components, error_reward=cfg.rollout.error_reward,
                              skipped=skipped, failed_reward=failed_reward)
        scored[record.group_id][record.rollout_id] = float(record.reward if failed_reward is None else failed_reward)
    if not out:
        raise CaptureError(nothing_to_train([r.job.rollout_id for r in ok], skipped, capture.unattributed,
                                            components))
    return out, dict(scored)


# Failures that are not the policy's: the runtime's own timeout, and the server unreachable or failing.
_INFRASTRUCTURE = ("TimeoutError", "APITimeoutError", "APIConnectionError", "InternalServerError")


def policy_failure(r: RolloutResult) -> bool:
    """A failed rollout that rollout.failed_reward penalises: its agent raised (e.g. on output it could not parse,
    or a 400 for a prompt the episode grew past the context); never a reward fault or infrastructure."""
    return (r.status == "failed" and r.failed_in == "rollout"
            and not (r.error or "").startswith(tuple(f"{n}:" for n in _INFRASTRUCTURE)))


def nothing_to_train(rollouts: list[str], skipped: Counter, unattributed: int, components: list[str]) -> str:
    """Why an iteration has no transition at all, in words, from what was seen."""
    seen = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()) if n) or "nothing left out"
    if skipped["no_llm_call"] == len(rollouts):
        why = (f"no LLM call was captured: no rollout (e.g. rollout {rollouts[0] if rollouts else '-'}) made an LLM "
               f"call the gateway could attribute to it; the agent must call the run's server (OPENAI_BASE_URL, or "
               f"the `llm` argument's base_url) inside the @rollout function")
        if unattributed:
            why += (f"; the gateway served {unattributed} call(s) of no rollout: a client that sends no W3C "
                    f"traceparent, or a call made outside the rollout's context (docs/remote.md: the per-rollout "
                    f"base URL serves such clients)")
        fix = ""
    else:
        why, fix = cannot_train(skipped, components, [])
        fix = f" Fix: {fix}."
    return (f"no transitions from {len(rollouts)} rollouts: {why} (left out: {seen}).{fix} "
            f"`lightning check` shows each rollout")
