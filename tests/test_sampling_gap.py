"""Every sampling setting accepted for training is scored by the trainer exactly as the real CPU server sampled
it: real OpenAI-client calls through the gateway to the built-in server on 127.0.0.1, recorded into SQLite by the
gateway, records -> transitions -> one GRPO step, whose logprob_gap is the mean |trainer - server| log-prob of the
sampled tokens."""

import openai
import pytest
import torch

from lightning_sdk import tracing
from lightning_sdk.config import TrainConfig
from lightning_sdk.train.trainer import GRPOTrainer
from lightning_sdk.transitions import to_transitions

from .conftest import in_rollout

torch.set_num_threads(1)

SETTINGS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.3, top_p=0.6),
            dict(temperature=1.0, top_p=0.9)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_trainer_log_probs_match_the_server(gw, store, tiny_model_path, sampling):
    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    ts = []
    for k in range(4):
        rid = f"r{k}"
        store.start_rollout(rid, task_id="t", group_id="g", iteration=0, phase="train")
        with in_rollout(gw, rid):
            client.chat.completions.create(model="gpt-4o-mini", max_tokens=12, seed=k,
                                           messages=[{"role": "user", "content": f"What is {k} + 4?"}], **sampling)
        store.finish_rollout(rid, status="succeeded", output="", reward=float(k % 2))
    assert gw.capture.flush()
    tracing.flush()
    for k in range(4):
        ts += to_transitions(store.rollout(f"r{k}"), store.spans(f"r{k}"))
    assert len(ts) == 4 and all(t.logprobs for t in ts)
    assert {(t.temperature, t.top_p) for t in ts} == {(sampling["temperature"], sampling.get("top_p", 1.0))}
    m = GRPOTrainer(tiny_model_path, TrainConfig(device="cpu")).step(ts)
    print(f"logprob_gap {sampling}: {m['logprob_gap']:.2e}")
    assert m["logprob_gap"] < 1e-5
