"""Spans of one rollout -> training transitions (one per LLM call of the chosen components)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from lightning_sdk.credit import CreditRule, lightning_rl
from lightning_sdk.errors import CaptureError
from lightning_sdk.store import RolloutRecord
from lightning_sdk.tracing.records import (COMPLETION_IDS, COMPLETION_LOGPROBS, PROMPT_IDS, REWARD_SPAN, REWARD_VALUE,
                                           SpanRecord)

__all__ = ["CaptureError", "Transition", "is_llm_call", "to_transitions"]


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
    reward: float  # episode reward shared out by the credit rule, plus this call's intermediate rewards
    temperature: float = 1.0  # > 0: the temperature the trainer scales logits by (see _train_temperature)


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
) -> list[Transition]:
    """One rollout's spans -> one transition per successful LLM call of the chosen components.

    Intermediate rewards go to the LLM call made just before them (or the first call, if none came before):
    `emit_reward` spans, and `error_reward` for each failed span (an LLM call or a tool that raised).
    """
    if rollout.reward is None:
        raise ValueError(f"rollout {rollout.rollout_id} has no reward; only scored rollouts become transitions")
    ordered = sorted(spans, key=lambda s: (s.start_ns, s.end_ns))
    calls = [s for s in ordered if is_llm_call(s) and not s.is_error]
    if not calls:
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
    extra = {s.span_id: 0.0 for s in calls}
    position = {s.span_id: i for i, s in enumerate(ordered)}
    for s in ordered:
        value = None
        if s.name == REWARD_SPAN:
            value = float(s.attributes.get(REWARD_VALUE, 0.0))
        elif s.is_error:
            value = error_reward
        if value is None:
            continue
        before = [c for c in calls if position[c.span_id] < position[s.span_id] and c.end_ns <= s.end_ns]
        extra[(before[-1] if before else calls[0]).span_id] += value

    wanted = set(components)
    chosen = [c for c in calls if not wanted or c.component in wanted]
    shares = list(credit(float(rollout.reward), chosen))
    if len(shares) != len(chosen):
        raise ValueError(f"credit rule returned {len(shares)} rewards for {len(chosen)} calls")
    out = []
    for i, (call, share) in enumerate(zip(chosen, shares)):
        a = call.attributes
        logprobs = a.get(COMPLETION_LOGPROBS)
        out.append(Transition(
            rollout_id=rollout.rollout_id,
            group_id=rollout.group_id,
            span_id=call.span_id,
            index=i,
            component=call.component,
            prompt_ids=tuple(a[PROMPT_IDS]),
            completion_ids=tuple(a[COMPLETION_IDS]),
            logprobs=tuple(logprobs) if logprobs is not None else None,
            reward=float(share) + extra[call.span_id],
            temperature=_train_temperature(a.get("gen_ai.request.temperature")),
        ))
    return out


def _train_temperature(sampled_at: float | None) -> float:
    # Greedy calls (temperature 0) are scored at temperature 1: dividing logits by 0 has no meaning.
    return float(sampled_at) if sampled_at is not None and sampled_at > 0 else 1.0
