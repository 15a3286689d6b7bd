"""Spans of one rollout -> training transitions (one per trainable LLM call of the chosen components).

The credit rule (docs/credit.md): every transition carries its rollout's episode reward (the outcome the group
baseline compares), its credit weight from `rollout.credit`, and its shaping: the intermediate rewards credited to
it. An intermediate reward (an `emit_reward` span, or `error_reward` for a failed tool) goes, once, to the latest
trained LLM call that ended before it; one with no such call is left out and counted. Calls that are not samples
of the policy the trainer can score are left out and counted too: failed calls (no completion; never penalised,
their error is the server's or the context limit's, not another call's), greedy calls (temperature 0: an argmax
is not a sample) and n > 1 calls (the span does not say which choice the agent acted on).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

from lightning_sdk import credit as credit_rules
from lightning_sdk.credit import CreditRule, lightning_rl
from lightning_sdk.errors import CaptureError
from lightning_sdk.store import RolloutRecord
from lightning_sdk.tracing.records import (COMPLETION_IDS, COMPLETION_LOGPROBS, PROMPT_IDS, REWARD_SPAN, REWARD_VALUE,
                                           SpanRecord)

__all__ = ["CaptureError", "Transition", "is_llm_call", "to_transitions"]

# Sampling settings the trainer cannot reproduce from logits alone (the CPU server ignores them; vLLM applies them).
_UNREPRODUCIBLE = ("gen_ai.request.frequency_penalty", "gen_ai.request.presence_penalty")


@dataclass(frozen=True)
class Transition:
    """One LLM call as the trainer sees it: exact token ids from the server and the reward credited to it."""

    rollout_id: str
    group_id: str  # rollouts that share a group_id (same task, same iteration) form one GRPO group
    span_id: str
    index: int  # order of this call within its rollout
    component: str | None
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # the sampler's log-probs of completion_ids, as the server reported them
    reward: float  # what this call is credited with, in reward units: episode reward + shaping (for display)
    temperature: float = 1.0  # > 0: the temperature the call was sampled at (greedy calls never become transitions)
    episode_reward: float | None = None  # the rollout's outcome, the same for all its calls; None: `reward`
    shaping: float = 0.0  # the intermediate rewards credited to this call
    credit: float = 1.0  # this call's share (>= 0) of its rollout's advantage, from the credit rule
    top_p: float = 1.0  # the nucleus it was sampled from; the trainer renormalises over the same one
    finish_reason: str | None = None  # "length": cut by max_tokens (train.mask_truncated leaves it out of the loss)

    @property
    def outcome(self) -> float:
        return self.reward if self.episode_reward is None else self.episode_reward


def is_llm_call(span: SpanRecord) -> bool:
    return span.name != REWARD_SPAN and (COMPLETION_IDS in span.attributes or PROMPT_IDS in span.attributes
                                         or span.attributes.get("gen_ai.operation.name") == "chat")


def to_transitions(
    rollout: RolloutRecord,
    spans: Sequence[SpanRecord],
    *,
    credit: CreditRule = lightning_rl,
    components: Iterable[str] = (),
    error_reward: float = -1.0,
    failed_reward: float | None = None,
    skipped: Counter | None = None,
) -> list[Transition]:
    """One rollout's spans -> one transition per trainable LLM call of the chosen components.

    A scored rollout trains with its reward; a failed one only when `failed_reward` is given (its captured calls
    then train with that episode reward, and a failure before any call gives no transitions). `skipped` counts
    what was left out, by reason: "failed_call", "greedy", "n>1", "unassigned_reward".
    """
    skipped = Counter() if skipped is None else skipped
    episode = failed_reward if failed_reward is not None else rollout.reward
    if episode is None:
        raise ValueError(f"rollout {rollout.rollout_id} has no reward; only scored rollouts become transitions")
    ordered = sorted(spans, key=lambda s: (s.start_ns, s.end_ns))
    calls = [s for s in ordered if is_llm_call(s) and not s.is_error]
    skipped["failed_call"] += sum(1 for s in ordered if is_llm_call(s) and s.is_error)
    if not calls:
        if failed_reward is not None:
            return []
        raise CaptureError(
            f"rollout {rollout.rollout_id} (task {rollout.task_id}) finished but no LLM call was captured: the agent "
            f"must call the server at llm.base_url through the openai client inside the @rollout function"
        )
    missing = [s.span_id for s in calls if COMPLETION_IDS not in s.attributes or PROMPT_IDS not in s.attributes]
    if missing:
        raise CaptureError(
            f"rollout {rollout.rollout_id}: {len(missing)} LLM call(s) without token ids (span {missing[0]}): the "
            f"server did not return prompt_token_ids/token_ids, and sampled text is never re-tokenized"
        )
    wanted = set(components)
    chosen = []
    for c in calls:
        if wanted and c.component not in wanted:
            continue
        a = c.attributes
        if a.get("gen_ai.request.temperature") == 0:
            skipped["greedy"] += 1
        elif len(a.get("gen_ai.response.finish_reasons") or ()) > 1:
            skipped["n>1"] += 1
        else:
            for key in _UNREPRODUCIBLE:
                if a.get(key):
                    raise CaptureError(f"rollout {rollout.rollout_id}: LLM call {c.span_id} was sampled with "
                                       f"{key.rsplit('.', 1)[1]}={a[key]}, which the trainer cannot reproduce; "
                                       f"leave it unset for the components being trained")
            chosen.append(c)
    if not chosen:
        return []

    shaping = {c.span_id: 0.0 for c in chosen}
    for s, value in _intermediate_rewards(ordered, error_reward):
        before = [c for c in chosen if c.end_ns <= s.end_ns and c.start_ns <= s.start_ns]
        if before:
            shaping[before[-1].span_id] += value
        else:
            skipped["unassigned_reward"] += 1
    weights = credit_rules.weights(credit, chosen)
    out = []
    for i, (call, w) in enumerate(zip(chosen, weights)):
        a = call.attributes
        logprobs = a.get(COMPLETION_LOGPROBS)
        finish = a.get("gen_ai.response.finish_reasons") or ()
        out.append(Transition(
            rollout_id=rollout.rollout_id,
            group_id=rollout.group_id,
            span_id=call.span_id,
            index=i,
            component=call.component,
            prompt_ids=tuple(a[PROMPT_IDS]),
            completion_ids=tuple(a[COMPLETION_IDS]),
            logprobs=tuple(logprobs) if logprobs is not None else None,
            reward=float(episode) + shaping[call.span_id],
            temperature=_number(a, "gen_ai.request.temperature", 1.0),
            episode_reward=float(episode),
            shaping=shaping[call.span_id],
            credit=w,
            top_p=_number(a, "gen_ai.request.top_p", 1.0),
            finish_reason=finish[0] if finish else None,
        ))
    return out


def _intermediate_rewards(ordered: Sequence[SpanRecord], error_reward: float) -> list[tuple[SpanRecord, float]]:
    """(span, value) of each intermediate reward: `emit_reward` spans, and `error_reward` once per failure.

    A failure that makes its parents fail too (a tool span inside a framework's step span) is the innermost error
    span only; a failed LLM call is never one (nothing the policy sampled failed; its error is the server's).
    """
    errors = {s.span_id for s in ordered if s.is_error}
    parent = {s.span_id: s.parent_id for s in ordered}
    has_failed_child: set[str] = set()
    for sid in errors:
        p = parent.get(sid)
        while p is not None and p not in has_failed_child:
            has_failed_child.add(p)
            p = parent.get(p)
    out = []
    for s in ordered:
        if s.name == REWARD_SPAN:
            out.append((s, float(s.attributes.get(REWARD_VALUE, 0.0))))
        elif s.is_error and s.span_id not in has_failed_child and not is_llm_call(s):
            out.append((s, error_reward))
    return out


def _number(attributes: dict, key: str, default: float) -> float:
    """A sampling setting of the call; absent (or recorded as null) means the server's default."""
    value = attributes.get(key)
    return default if value is None else float(value)
