"""Evals that say what they are: a score on the training tasks is never called held-out, every score carries its
standard error, and an eval rollout samples the same reply whatever else the server is decoding beside it, while
training calls stay unseeded. Real calls through the run's gateway to the built-in server on 127.0.0.1."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from lightning_sdk.evals import EvalScore, eval_seed, split_of
from lightning_sdk.tracing.records import COMPLETION_IDS

from .conftest import in_rollout, recorded_calls

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def test_split_of_says_whether_the_eval_tasks_are_training_tasks():
    assert split_of(["a", "b"], ["a", "b", "c"]) == ("train", 2)
    assert split_of(["x", "y"], ["a", "b"]) == ("held-out", 0)
    assert split_of(["a", "y"], ["a", "b"]) == ("mixed", 1)
    assert EvalScore.of([1.0], "train").words == "score on the training tasks"
    assert EvalScore.of([1.0], "held-out").words == "held-out score"
    assert EvalScore.of([1.0, 0.0, 0.0], "mixed", 1).words == "score on tasks partly seen in training (1 of 3)"


def test_an_eval_score_carries_its_standard_error():
    score = EvalScore.of([1.0, 0.0, 1.0, 0.0])
    assert score.mean == 0.5 and score.n == 4
    assert score.stderr == pytest.approx(math.sqrt(1 / 3) / 2)  # sample std / sqrt(n)
    assert str(score) == "0.500 ± 0.289"
    assert EvalScore.of([0.7]).stderr is None and str(EvalScore.of([0.7])) == "0.700"


def test_eval_seeds_depend_on_the_run_seed_and_the_task_only():
    assert eval_seed(0, "3+4") == eval_seed(0, "3+4") != eval_seed(1, "3+4") != eval_seed(0, "4+3")
    assert 0 <= eval_seed(0, "3+4") < 2**63


def ask(gw, store, rollout_id: str, phase: str, rollout_seed: int | None, crowd: int = 0, **extra) -> tuple[dict, str]:
    """One call in a rollout, with `crowd` unseeded calls of other prompts sent at the same time (so decoded in
    the same batches); the attributes of the gateway's record of the call, and the reply."""
    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)

    def other(i: int) -> None:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"What is {i} + {i}?"}],
                                       max_tokens=12)

    with ThreadPoolExecutor(max(1, crowd)) as pool:
        others = [pool.submit(other, i) for i in range(crowd)]
        with in_rollout(gw, rollout_id, phase=phase, seed=rollout_seed):
            reply = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8, temperature=1.0,
                                                   **extra).choices[0].message.content
        for f in others:
            f.result()
    [call] = recorded_calls(gw, store, rollout_id)
    return call.attributes, reply


def test_an_eval_call_gets_its_rollouts_seed_and_the_same_reply_in_any_batch(gw, store):
    seed = eval_seed(0, "3+4")
    alone, reply_alone = ask(gw, store, "eval-a", "eval", seed)
    crowded, reply_crowded = ask(gw, store, "eval-b", "eval", seed, crowd=6)  # decoded beside six other calls
    assert alone["gen_ai.request.seed"] == seed == crowded["gen_ai.request.seed"]
    assert reply_crowded == reply_alone and crowded[COMPLETION_IDS] == alone[COMPLETION_IDS]


def test_training_calls_stay_unseeded_and_an_agents_own_seed_wins(gw, store):
    train, _ = ask(gw, store, "it0001-a", "train", None)
    assert "gen_ai.request.seed" not in train
    own, _ = ask(gw, store, "eval-own", "eval", eval_seed(0, "3+4"), seed=7)
    assert own["gen_ai.request.seed"] == 7
