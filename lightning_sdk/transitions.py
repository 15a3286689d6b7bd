"""Spans of one rollout -> training transitions (one per trainable LLM call of the chosen components).

The LLM calls are the gateway's records (`records.is_llm_call`): token ids, log-probs and sampling settings come
from what the gateway received and the backend produced, never from an agent's spans. The agent's spans give the
intermediate rewards: `emit_reward` spans, and failed tools.

The credit rule (docs/credit.md): every transition carries its rollout's episode reward (the outcome the group
baseline compares), its credit weight from `rollout.credit`, and its shaping: the intermediate rewards credited to
it. An intermediate reward (an `emit_reward` span, or `error_reward` for a failed tool) goes, once, to the latest
trained LLM call the agent had seen the reply of when it came (`lightning.after_call`, ordered by the gateway,
not by clocks); one with no such call is left out and counted. Calls that are not samples of the policy the
trainer can score are left out and counted too, by reason: failed calls (no completion; never penalised, their
error is the server's or the context limit's), greedy calls (temperature 0: an argmax is not a sample), n > 1
calls (which choice the agent acted on is unknown), and calls with a sampling setting the trainer cannot
reproduce ("setting:top_k", ...). A rollout with no trainable call gives no transitions; that is counted, never
an error.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

from lightning_sdk import credit as credit_rules
from lightning_sdk.agent import RewardError, reward_value
from lightning_sdk.credit import CreditRule, lightning_rl
from lightning_sdk.store import RolloutRecord
from lightning_sdk.tracing.records import (AFTER_CALL, COMPLETION_IDS, COMPLETION_LOGPROBS, CONSTRAINT, POLICY,
                                           PROMPT_IDS, REWARD_SPAN, REWARD_VALUE, UNREPRODUCIBLE, SpanRecord,
                                           is_llm_call)

__all__ = ["Transition", "is_llm_call", "to_transitions"]

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
    policy: str | None = None  # the adapter (or base model) name that served the call, as the gateway recorded it
    constraint: str | None = None  # the output constraint it was sampled under (the trainer replays its grammar)

    @property
    def outcome(self) -> float:
        return self.reward if self.episode_reward is None else self.episode_reward


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
    """One rollout's spans (the gateway's call records and the agent's spans) -> one transition per trainable LLM
    call of the chosen components.

    A scored rollout trains with its reward; a failed one only when `failed_reward` is given (its calls then train
    with that episode reward). `skipped` counts what was left out, by reason: "no_llm_call" (a rollout that made
    none), "failed_call", "greedy", "n>1", "setting:<name>", "other_component" (not of `components`), "bad_token_ids",
    "unassigned_reward", "bad_reward".
    """
    skipped = Counter() if skipped is None else skipped
    episode = failed_reward if failed_reward is not None else rollout.reward
    if episode is None:
        raise ValueError(f"rollout {rollout.rollout_id} has no reward; only scored rollouts become transitions")
    calls = sorted((s for s in spans if is_llm_call(s)), key=lambda s: (s.start_ns, s.end_ns, s.span_id))
    if not calls:
        skipped["no_llm_call"] += 1
        return []
    ok = [c for c in calls if not c.is_error]
    if len(ok) < len(calls):
        skipped["failed_call"] += len(calls) - len(ok)
    wanted = set(components)
    chosen = []
    for c in ok:
        if wanted and c.component not in wanted:
            skipped["other_component"] += 1  # another role (a judge, another provider's model): not looked at further
            continue
        reason = _left_out(c.attributes)
        if reason is not None:
            skipped[reason] += 1
        else:
            chosen.append(c)
    if not chosen:
        return []

    shaping = {c.span_id: 0.0 for c in chosen}
    order = {c.span_id: i for i, c in enumerate(calls)}
    for value, after, span in _intermediate_rewards(spans, error_reward, skipped):
        if after is not None:
            seen = order.get(after, -1)
            before = [c for c in chosen if order[c.span_id] <= seen]
        else:  # the agent's client told us no call id (not a client propagation covers): the clock, then
            before = [c for c in chosen if c.end_ns <= span.end_ns and c.start_ns <= span.start_ns]
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
            policy=a.get(POLICY),
            constraint=a.get(CONSTRAINT) if isinstance(a.get(CONSTRAINT), str) else None,
        ))
    return out


def _left_out(a: dict) -> str | None:
    """Why a successful call cannot train, or None."""
    if a.get("gen_ai.request.temperature") == 0:
        return "greedy"
    if len(a.get("gen_ai.response.finish_reasons") or ()) > 1:
        return "n>1"
    settings = a.get(UNREPRODUCIBLE) or ()
    if settings:
        return f"setting:{settings[0]}"
    prompt, completion = a.get(PROMPT_IDS), a.get(COMPLETION_IDS)
    if not (_ids(prompt) and _ids(completion)):
        return "bad_token_ids"
    lps = a.get(COMPLETION_LOGPROBS)
    if lps is not None and (len(lps) != len(completion) or not all(isinstance(x, (int, float)) and x <= 0
                                                                    and math.isfinite(x) for x in lps)):
        return "bad_token_ids"
    return None


def _ids(ids: object) -> bool:
    return isinstance(ids, list) and bool(ids) and all(type(i) is int and i >= 0 for i in ids)


def _intermediate_rewards(spans: Sequence[SpanRecord], error_reward: float,
                          skipped: Counter) -> list[tuple[float, str | None, SpanRecord]]:
    """(value, the call the agent had seen, the span) of each intermediate reward: `emit_reward` spans, and `error_reward`
    once per failure.

    A failure that makes its parents fail too (a tool span inside a framework's step span) is the innermost error
    span only; a failed LLM call is never one (nothing the policy sampled failed; its error is the server's).
    """
    agent = [s for s in sorted(spans, key=lambda s: (s.start_ns, s.end_ns)) if not is_llm_call(s)]
    errors = {s.span_id for s in agent if s.is_error}
    parent = {s.span_id: s.parent_id for s in agent}
    has_failed_child: set[str] = set()
    for sid in errors:
        p = parent.get(sid)
        while p is not None and p not in has_failed_child:
            has_failed_child.add(p)
            p = parent.get(p)
    out = []
    for s in agent:
        after = s.attributes.get(AFTER_CALL)
        after = after if isinstance(after, str) else None
        if s.name == REWARD_SPAN:
            try:
                value = reward_value(s.attributes.get(REWARD_VALUE), "reward span")
            except RewardError:
                skipped["bad_reward"] += 1  # a worker's span is checked where it comes in; this is the last guard
                continue
            out.append((value, after, s))
        elif s.is_error and s.span_id not in has_failed_child:
            out.append((error_reward, after, s))
    return out


def _number(attributes: dict, key: str, default: float) -> float:
    """A sampling setting of the call; absent (or recorded as null) means the server's default."""
    value = attributes.get(key)
    return default if value is None else float(value)
