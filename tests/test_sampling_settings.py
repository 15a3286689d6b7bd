"""The built-in server serves the sampling settings it is asked for or refuses them by name, never ignores them:
top_k is applied (as vLLM applies it), a constraint the grammar engine cannot serve is a 400 naming its part. A real server
subprocess on 127.0.0.1 and the real openai client; through the gateway, such a call is recorded and left out of
training by name."""

from __future__ import annotations

import json
import math
from collections import Counter

import openai
import pytest

from lightning_sdk.transitions import to_transitions
from tests.conftest import SERVED, in_rollout, recorded_calls

QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none", max_retries=0)


def test_top_k_one_samples_the_most_probable_token(client):
    out = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=6, temperature=1.5, n=8,
                                         logprobs=True, top_logprobs=3, extra_body={"top_k": 1})
    assert len({c.message.content for c in out.choices}) == 1  # every sample the argmax: top_k is not ignored
    greedy = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=6, temperature=0)
    assert out.choices[0].message.content == greedy.choices[0].message.content
    for token in out.choices[0].logprobs.content:  # the distribution drawn from: all mass on one token
        assert token.logprob == 0.0 and [t.logprob for t in token.top_logprobs][1:] == [-9999.0, -9999.0]


def test_top_k_keeps_k_tokens_renormalised(client):
    out = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=4, temperature=1.0,
                                         logprobs=True, top_logprobs=4, extra_body={"top_k": 2}, seed=3)
    for token in out.choices[0].logprobs.content:
        top = [t.logprob for t in token.top_logprobs]
        assert top[2:] == [-9999.0, -9999.0] and math.exp(top[0]) + math.exp(top[1]) == pytest.approx(1.0, abs=1e-5)
    assert client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=2,
                                          extra_body={"top_k": -1}).choices[0].message.content is not None


BAD_CONSTRAINTS = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"n": {"type": "nonsense"}}}}}), "response_format.json_schema.schema",
     'Unsupported type "nonsense"'),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a"}}), "response_format.json_schema.schema",
     "expected a JSON schema"),
    (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs.regex", "parenthesis"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "exactly one"),
    (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json", "structured_outputs"),
    (dict(response_format={"type": "json_object"}, tool_choice="required",
          tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice", "both constrain"),
]


@pytest.mark.parametrize("request_fields,param,why", BAD_CONSTRAINTS, ids=[p for _, p, _ in BAD_CONSTRAINTS])
def test_a_constraint_the_grammar_engine_cannot_serve_is_a_400_naming_the_part(client, request_fields, param, why):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=4, **request_fields)
    assert e.value.body["param"] == param and why in e.value.body["message"]
    text = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=2,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason in ("stop", "length")


def test_a_completion_cut_inside_a_grammar_is_recorded_as_truncated(gw, store):
    agent = openai.OpenAI(base_url=gw.base_url, api_key="agents", max_retries=0)
    schema = {"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}
    with in_rollout(gw, "cut"):
        out = agent.chat.completions.create(model="m", messages=QUESTION, max_tokens=3, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert out.choices[0].finish_reason == "length"
    (call,) = recorded_calls(gw, store, "cut")
    assert call.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert json.loads(call.attributes["lightning.llm.constraint"])["kind"] == "json_schema"
    store.start_rollout("cut", task_id="t", group_id="g", iteration=0, phase="train")
    store.finish_rollout("cut", status="succeeded", output="", reward=1.0)
    (t,) = to_transitions(store.rollout("cut"), store.spans("cut"))
    assert t.finish_reason == "length" and t.constraint  # train.mask_truncated decides; the record says it


def test_a_top_k_call_is_served_and_left_out_of_training_by_name(gw, store):
    agent = openai.OpenAI(base_url=gw.base_url, api_key="agents", max_retries=0)
    with in_rollout(gw, "topk"):
        agent.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=3, extra_body={"top_k": 5})
        agent.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=3)
    assert len(recorded_calls(gw, store, "topk")) == 2
    store.add_tasks([("t", {"q": 1})])
    store.start_rollout("topk", task_id="t", group_id="g", iteration=1, phase="train")
    store.finish_rollout("topk", status="succeeded", reward=1.0, output="x")
    skipped: Counter = Counter()
    ts = to_transitions(store.rollout("topk"), store.spans("topk"), skipped=skipped)
    assert len(ts) == 1 and skipped == Counter({"setting:top_k": 1})
