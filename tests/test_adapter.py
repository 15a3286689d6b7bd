"""Spans -> transitions: components of interest, intermediate rewards, credit rules, what cannot train counted."""

from collections import Counter

import pytest

from lightning_sdk import credit
from lightning_sdk.transitions import to_transitions
from lightning_sdk.store import RolloutRecord, Store
from lightning_sdk.tracing import (COMPLETION_IDS, COMPLETION_LOGPROBS, PROMPT_IDS, REWARD_NAME, REWARD_SPAN,
                                   REWARD_VALUE, SpanRecord)


def rollout(reward=1.0, rid="r1"):
    return RolloutRecord(rollout_id=rid, task_id="t", group_id="0:0", iteration=0, phase="train", attempt=1,
                         model="m", status="succeeded", output="x", reward=reward, error=None, traceback=None,
                         started_at=0.0, ended_at=1.0)


def llm_span(i, component=None, *, status="OK", prompt=(1, 2), completion=(3, 4), temperature=None, **extra):
    attrs = {"gen_ai.operation.name": "chat", PROMPT_IDS: list(prompt), COMPLETION_IDS: list(completion),
             COMPLETION_LOGPROBS: [-0.5] * len(completion), **extra}
    if temperature is not None:
        attrs["gen_ai.request.temperature"] = temperature
    if status == "ERROR":
        attrs = {"gen_ai.operation.name": "chat"}
    return SpanRecord(span_id=f"s{i}", trace_id="t", parent_id=None, rollout_id="r1", attempt=1, component=component,
                      name="chat m", start_ns=int(i * 10), end_ns=int(i * 10 + 5), status=status, status_message=None,
                      attributes=attrs, source="gateway")


def reward_span(i, value, name="step"):
    return SpanRecord(span_id=f"w{i}", trace_id="t", parent_id=None, rollout_id="r1", attempt=1, component=None,
                      name=REWARD_SPAN, start_ns=int(i * 10), end_ns=int(i * 10 + 1), status="UNSET", status_message=None,
                      attributes={REWARD_VALUE: value, REWARD_NAME: name})


def tool_error(i):
    return SpanRecord(span_id=f"e{i}", trace_id="t", parent_id=None, rollout_id="r1", attempt=1, component=None,
                      name="tool.run_sql", start_ns=i * 10, end_ns=i * 10 + 2, status="ERROR", status_message="bad",
                      attributes={})


def test_lightning_rl_gives_every_call_the_episode_reward():
    spans = [llm_span(0, "writer"), llm_span(1, "checker"), llm_span(2, "rewriter")]
    out = to_transitions(rollout(0.75), spans)
    assert [t.reward for t in out] == [0.75, 0.75, 0.75]
    assert [t.index for t in out] == [0, 1, 2]
    assert out[0].prompt_ids == (1, 2) and out[0].completion_ids == (3, 4) and out[0].logprobs == (-0.5, -0.5)
    assert out[0].group_id == "0:0" and out[0].rollout_id == "r1"


def test_only_components_of_interest_become_transitions():
    spans = [llm_span(0, "writer"), llm_span(1, "checker"), llm_span(2, "rewriter"), llm_span(3, "checker")]
    out = to_transitions(rollout(1.0), spans, components=["writer", "rewriter"])
    assert [t.component for t in out] == ["writer", "rewriter"]
    assert [t.span_id for t in out] == ["s0", "s2"]


def test_intermediate_rewards_go_to_the_preceding_call():
    spans = [reward_span(0, 0.1), llm_span(1), reward_span(2, 0.5), reward_span(3, -0.25), llm_span(4),
             tool_error(5), llm_span(6)]
    skipped = Counter()
    out = to_transitions(rollout(1.0), spans, error_reward=-1.0, skipped=skipped)
    # the reward before any call goes to no call (none ended before it), and is counted
    assert [t.shaping for t in out] == pytest.approx([0.5 - 0.25, -1.0, 0.0])
    assert [t.reward for t in out] == pytest.approx([1.0 + 0.5 - 0.25, 1.0 - 1.0, 1.0])
    assert [t.episode_reward for t in out] == [1.0] * 3 and skipped["unassigned_reward"] == 1


def test_failed_llm_call_is_not_a_transition_and_costs_no_other_call():
    # e.g. a prompt over max_model_len: the server's 400 is no fault of the call before it
    spans = [llm_span(0), llm_span(1, status="ERROR"), llm_span(2)]
    skipped = Counter()
    out = to_transitions(rollout(0.0), spans, error_reward=-0.5, skipped=skipped)
    assert [t.span_id for t in out] == ["s0", "s2"]
    assert [t.reward for t in out] == [0.0, 0.0] and skipped["failed_call"] == 1


def test_intermediate_reward_after_an_untrained_component_goes_to_the_trained_call_before_it():
    spans = [llm_span(0, "writer"), llm_span(1, "checker"), reward_span(2, -1.0)]
    out = to_transitions(rollout(1.0), spans, components=["writer"])
    assert [t.shaping for t in out] == [-1.0]  # not lost: the writer's call ended before it


def test_last_call_rule_and_custom_rule():
    spans = [llm_span(0), llm_span(1), llm_span(2)]
    out = to_transitions(rollout(2.0), spans, credit=credit.last_call)
    assert [t.credit for t in out] == [0.0, 0.0, 1.0] and [t.episode_reward for t in out] == [2.0] * 3
    rule = credit.resolve("tests.credit_rules:halves")
    assert [t.credit for t in to_transitions(rollout(2.0), spans, credit=rule)] == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="rollout.credit"):
        credit.resolve("nonsense")


def test_greedy_and_n_choice_calls_are_left_out_and_counted():
    skipped = Counter()
    out = to_transitions(rollout(), [llm_span(0, temperature=0.0), llm_span(1, temperature=0.7),
                                     llm_span(2, **{"gen_ai.response.finish_reasons": ["stop", "length"]})],
                         skipped=skipped)
    assert [t.span_id for t in out] == ["s1"] and out[0].temperature == 0.7
    assert skipped["greedy"] == 1 and skipped["n>1"] == 1


def test_sampling_settings_are_captured_and_unreproducible_ones_left_out_by_name():
    [t] = to_transitions(rollout(), [llm_span(0, temperature=1.3, **{"gen_ai.request.top_p": 0.6,
                                                                   "gen_ai.response.finish_reasons": ["length"]})])
    assert (t.temperature, t.top_p, t.finish_reason) == (1.3, 0.6, "length")
    skipped = Counter()
    out = to_transitions(rollout(), [llm_span(0, **{"lightning.llm.unreproducible": ["frequency_penalty"]}),
                                     llm_span(1, **{"lightning.llm.unreproducible": ["top_k"]}), llm_span(2)],
                         skipped=skipped)
    assert [t.span_id for t in out] == ["s2"]  # one call's setting never stops a run
    assert skipped == {"setting:frequency_penalty": 1, "setting:top_k": 1}


def test_failed_rollout_trains_at_failed_reward():
    failed = rollout(None)
    with pytest.raises(ValueError, match="no reward"):
        to_transitions(failed, [llm_span(0)])
    out = to_transitions(failed, [llm_span(0), llm_span(1, status="ERROR")], failed_reward=-1.0)
    assert [(t.span_id, t.episode_reward, t.shaping) for t in out] == [("s0", -1.0, 0.0)]
    assert to_transitions(failed, [], failed_reward=-1.0) == []  # failed before any call: nothing to train


def test_a_rollout_without_an_llm_call_has_nothing_to_train_and_is_counted():
    skipped = Counter()
    assert to_transitions(rollout(), [reward_span(0, 1.0)], skipped=skipped) == []
    assert skipped == {"no_llm_call": 1}


def test_an_agent_s_own_span_with_token_ids_is_never_a_call():
    """Only the gateway's record is an LLM call: a span an agent or worker sends with ids trains nothing."""
    forged = llm_span(0)
    forged.source = "agent"
    assert to_transitions(rollout(), [forged], skipped=(skipped := Counter())) == [] and skipped["no_llm_call"] == 1


@pytest.mark.parametrize("bad", [{COMPLETION_IDS: [3, -5]}, {PROMPT_IDS: "1 2"}, {COMPLETION_IDS: []},
                                 {COMPLETION_LOGPROBS: [-0.5]}, {COMPLETION_LOGPROBS: [float("nan"), -1.0]}])
def test_a_record_with_bad_ids_or_logprobs_is_left_out_and_counted(bad):
    span = llm_span(0)
    span.attributes.update(bad)
    skipped = Counter()
    assert to_transitions(rollout(), [span, llm_span(1)], skipped=skipped)[0].span_id == "s1"
    assert skipped == {"bad_token_ids": 1}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "abc", 1e300])
def test_a_reward_span_that_is_not_a_bounded_number_is_left_out_and_counted(value):
    skipped = Counter()
    [t] = to_transitions(rollout(), [llm_span(0), reward_span(1, value)], skipped=skipped)
    assert t.shaping == 0.0 and skipped == {"bad_reward": 1}


def test_round_trip_through_the_store(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.start_rollout("r1", task_id="t", group_id="0:0", iteration=0, phase="train")
    store.write_calls([llm_span(0, "writer")])  # the gateway's record
    store.write_spans([reward_span(1, 0.5), llm_span(2, "writer")])  # an agent's spans: the second is no call
    store.finish_rollout("r1", status="succeeded", output="x", reward=1.0)
    rec = store.rollout("r1")
    out = to_transitions(rec, store.spans("r1"))
    assert [(t.reward, t.shaping, t.episode_reward) for t in out] == [(1.5, 0.5, 1.0)]
    assert [(r["kind"], r["value"]) for r in store.rewards("r1")] == [("intermediate", 0.5), ("final", 1.0)]
    assert store.call_counts(["r1"]) == {"r1": 1}


def test_intermediate_rewards_reach_the_advantages():
    """An emit_reward penalty lowers that call's advantage below its sibling's in the same rollout."""
    from lightning_sdk.train.grpo import group_advantages

    penalised = to_transitions(rollout(1.0, rid="r1"), [llm_span(0), reward_span(1, -0.5), llm_span(2)])
    clean = [t.__class__(**{**t.__dict__, "rollout_id": "r2"})
             for t in to_transitions(rollout(0.0, rid="r2"), [llm_span(0), llm_span(2)])]
    ts = penalised + clean
    adv = group_advantages([t.outcome for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts],
                           shaping=[t.shaping for t in ts])
    assert adv[0] < adv[1] and adv[1] > 0 > adv[2] == adv[3]
