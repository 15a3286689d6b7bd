"""The credit rule's required properties (docs/credit.md), each on hand-computed numbers: spans -> transitions
(tests/test_adapter.py builds the spans) -> group_advantages."""

import dataclasses
import math

import pytest
import torch

from lightning_sdk import credit
from lightning_sdk.train.grpo import STD_EPS, group_advantages
from lightning_sdk.transitions import to_transitions
from tests.test_adapter import llm_span, reward_span, rollout, tool_error


def advantages(rollouts, scale="group"):
    """rollouts: [(reward, spans, kwargs)] of one group -> (transitions, advantages)."""
    ts = []
    for k, (reward, spans, kw) in enumerate(rollouts):
        ts += to_transitions(rollout(reward, rid=f"r{k}"), spans, **kw)
    adv = group_advantages([t.outcome for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts], scale,
                           credit=[t.credit for t in ts], shaping=[t.shaping for t in ts])
    return ts, adv


def two_calls():
    return [llm_span(0), llm_span(1)]


def test_last_call_has_the_right_sign():
    # Defect 1: 2 rollouts x 2 calls, outcomes 1 and 0. Outcomes [1, 0]: mean 0.5, std sqrt(0.5).
    a = 0.5 / (math.sqrt(0.5) + STD_EPS)
    _, adv = advantages([(1.0, two_calls(), {"credit": credit.last_call}), (0.0, two_calls(), {"credit": credit.last_call})])
    assert adv.tolist() == pytest.approx([0.0, a, 0.0, -a], abs=1e-6)  # the winner's first call is not pushed down
    _, adv = advantages([(1.0, two_calls(), {}), (0.0, two_calls(), {})])
    assert adv.tolist() == pytest.approx([a, a, -a, -a], abs=1e-6)


@pytest.mark.parametrize("rule", [credit.lightning_rl, credit.last_call])
def test_same_outcome_and_no_intermediate_rewards_give_zero(rule):
    # Defect 1, second case: four rollouts that all succeed
    _, adv = advantages([(1.0, two_calls(), {"credit": rule}) for _ in range(4)])
    assert torch.equal(adv, torch.zeros(8))


def test_error_penalties_alone_make_no_signal():
    # Defect 2, last case: 8 rollouts all scoring 0, one tool error: nothing to learn from the outcome, so nothing
    spans = [[llm_span(0), tool_error(1), llm_span(2)]] + [[llm_span(0), llm_span(2)]] * 7
    ts, adv = advantages([(0.0, s, {"error_reward": -1.0}) for s in spans])
    assert ts[0].shaping == -1.0 and torch.equal(adv, torch.zeros(len(ts)))


@pytest.mark.parametrize("rule", [credit.lightning_rl, credit.last_call])
def test_no_call_goes_negative_from_its_position(rule):
    # a winning rollout of 5 calls against two losers: every call of it >= 0, every call of a loser <= 0
    long = [llm_span(i) for i in range(5)]
    _, adv = advantages([(1.0, long, {"credit": rule}), (0.0, two_calls(), {"credit": rule}),
                         (0.0, [llm_span(0)], {"credit": rule})])
    assert (adv[:5] >= 0).all() and adv[4] > 0 and (adv[5:] <= 0).all()


def test_credit_weights_must_not_be_negative():
    with pytest.raises(ValueError, match="weight -1.0"):
        to_transitions(rollout(), two_calls(), credit=credit.resolve("tests.credit_rules:negative"))


# Outcomes [1, 1, 0, 0]: mean 0.5, std sqrt(1/3); the winners' advantage A = 0.5 / (std + eps).
D = math.sqrt(1 / 3) + STD_EPS
A = 0.5 / D
# Rollout r0 failing outright (outcome 0): outcomes [0, 1, 0, 0], mean 0.25, std 0.5.
A_FAILED = -0.25 / (0.5 + STD_EPS)


def group_with_error(error_reward):
    r0 = [llm_span(0), tool_error(1), llm_span(2)]  # the tool fails after r0's first call
    return advantages([(1.0, r0, {"error_reward": error_reward}), (1.0, two_calls(), {}), (0.0, two_calls(), {}),
                       (0.0, two_calls(), {})])


def test_one_tool_error_changes_only_its_call_and_no_more_than_failing():
    _, clean = group_with_error(0.0)
    assert clean.tolist() == pytest.approx([A, A, A, A, -A, -A, -A, -A], abs=1e-6)
    # a small error: shaping -0.25 / D on the call before it, nothing else moves
    ts, adv = group_with_error(-0.25)
    assert [t.shaping for t in ts] == [-0.25] + [0.0] * 7
    assert adv.tolist() == pytest.approx([A - 0.25 / D] + clean.tolist()[1:], abs=1e-6)
    # a large error (-1 / D = -1.73 would take it past an outright failure): it stops where failing would put it
    _, adv = group_with_error(-1.0)
    assert adv[0].item() == pytest.approx(A_FAILED, abs=1e-6)
    assert adv.tolist()[1:] == pytest.approx(clean.tolist()[1:], abs=1e-6)
    # ... which is what r0 failing outright (failed_reward 0) gives its calls
    failed = to_transitions(rollout(None, rid="r0"), [llm_span(0), tool_error(1), llm_span(2)], failed_reward=0.0,
                            error_reward=0.0)
    ts = failed + [t for t in group_with_error(0.0)[0] if t.rollout_id != "r0"]
    adv_f = group_advantages([t.outcome for t in ts], [t.group_id for t in ts], [t.rollout_id for t in ts])
    assert adv_f[0].item() == pytest.approx(A_FAILED, abs=1e-6)
    assert abs(adv[0] - clean[0]) <= abs(adv_f[0] - clean[0]) + 1e-6


def test_a_reward_is_credited_once_to_a_call_that_ended_before_it():
    parent = dataclasses.replace(tool_error(3), span_id="p3", start_ns=29, end_ns=36, name="agent.step")
    child = dataclasses.replace(tool_error(3), parent_id="p3")  # the tool fails, and its parent step with it
    spans = [reward_span(0, 0.5),  # before any call: no call ended before it, so nobody gets it
             llm_span(1, "writer"), llm_span(2, "checker"), reward_span(2.6, 0.25),  # after the untrained checker
             parent, child, llm_span(4, "writer")]
    from collections import Counter

    skipped = Counter()
    ts = to_transitions(rollout(1.0), spans, components=["writer"], error_reward=-1.0, skipped=skipped)
    assert [t.span_id for t in ts] == ["s1", "s4"]
    # the checker's 0.25 goes to the writer call before it; the tool error counts once, not twice
    assert [t.shaping for t in ts] == [0.25 - 1.0, 0.0]
    assert skipped["unassigned_reward"] == 1


def test_failed_reward_penalises_only_the_policys_failures():
    from lightning_sdk.rollouts.job import RolloutJob, RolloutResult
    from lightning_sdk.runtime import policy_failure

    job = RolloutJob(rollout_id="r", task_id="t", group_id="g", task={}, iteration=0)

    def failed(error, stage="rollout"):
        return RolloutResult(job, "failed", None, None, error, failed_in=stage)

    assert policy_failure(failed("ValueError: could not parse the model's answer"))
    assert policy_failure(failed("BadRequestError: Error code: 400 - the prompt has 3000 tokens"))
    assert not policy_failure(failed("TimeoutError: rollout r took longer than rollout.timeout=1s"))
    assert not policy_failure(failed("APIConnectionError: Connection error."))
    assert not policy_failure(failed("InternalServerError: Error code: 500"))
    assert not policy_failure(failed("@reward raised KeyError: 'x'", stage="reward"))
    assert not policy_failure(RolloutResult(job, "succeeded", 1.0))


def test_train_options_are_validated_at_the_edge():
    from lightning_sdk import config

    base = {"agent": {"module": "a.py"}, "data": {"train": "t.jsonl"}}
    with pytest.raises(config.ConfigError, match="train.max_completion_length"):
        config.parse({**base, "train": {"loss_norm": "constant"}})
    with pytest.raises(config.ConfigError, match="train.dual_clip"):
        config.parse({**base, "train": {"dual_clip": 0.5}})
    cfg = config.parse({**base, "rollout": {"failed_reward": -1}, "train": {"scale_rewards": "batch",
                        "lr_schedule": "cosine", "warmup_steps": 3, "mask_truncated": True}})
    assert cfg.rollout.failed_reward == -1.0 and cfg.train.scale_rewards == "batch"
