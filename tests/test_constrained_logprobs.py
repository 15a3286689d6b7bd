"""Structured outputs trained exactly: a call sampled under a grammar (response_format json_schema, vLLM's
structured_outputs, a forced tool_choice) on the built-in server reports the log-probs of the policy renormalised
over the tokens the grammar allowed; the gateway records the constraint; the trainer replays the grammar over the
sampled ids and its masked log-probs equal the server's, where the unmasked ones do not. Real OpenAI-client calls
through the gateway to the built-in server on 127.0.0.1, recorded into SQLite, one GRPO step."""

import json
from pathlib import Path

import openai
import pytest
import torch

from lightning_sdk import tracing
from lightning_sdk.config import TrainConfig
from lightning_sdk.constraint import Constraint
from lightning_sdk.train.trainer import GRPOTrainer
from lightning_sdk.transitions import to_transitions

from .conftest import in_rollout

torch.set_num_threads(1)

# properties out of alphabetical order: the grammar writes them in the schema's order, and the record keeps it
SCHEMA = {"type": "object", "properties": {"sure": {"type": "boolean"},
                                           "answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["sure", "answer"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}]
CONSTRAINTS = {
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "Answer", "schema": SCHEMA}}),
    "json_object": dict(response_format={"type": "json_object"}),
    "structured_outputs.choice": dict(extra_body={"structured_outputs": {"choice": ["seven", "eight", "nine"]}}),
    "structured_outputs.regex": dict(extra_body={"structured_outputs": {"regex": "[0-9]{1,2}"}}),
    "tool_choice.named": dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
    "tool_choice.required": dict(tools=TOOLS, tool_choice="required"),
    # tools offered, tool_choice unset: text, or a call held to its schema once `<tool_call>` begins it (as vLLM)
    "tools.auto": dict(tools=TOOLS),
    "tools.auto+response_format": dict(tools=TOOLS, response_format={"type": "json_schema", "json_schema": {
        "name": "Answer", "schema": SCHEMA}}),
}


def _calls(gw, store, constraint: dict, k: int = 4, **sampling):
    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    replies = []
    for i in range(k):
        rid = f"r{i}"
        store.start_rollout(rid, task_id="t", group_id="g", iteration=0, phase="train")
        with in_rollout(gw, rid):
            replies.append(client.chat.completions.create(
                model="gpt-4o-mini", max_tokens=40, seed=i, messages=[{"role": "user", "content": f"What is {i} + 4?"}],
                **sampling, **constraint))
        store.finish_rollout(rid, status="succeeded", output="", reward=float(i % 2))
    assert gw.capture.flush()
    tracing.flush()
    ts = [t for i in range(k) for t in to_transitions(store.rollout(f"r{i}"), store.spans(f"r{i}"))]
    return replies, ts


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_trainer_masked_log_probs_equal_the_server_s_under_a_grammar(gw, store, tiny_model_path, name):
    replies, ts = _calls(gw, store, CONSTRAINTS[name], temperature=1.0, top_p=0.95)
    assert len(ts) == 4 and all(t.constraint and t.logprobs for t in ts)  # trained, no longer left out
    for r in replies:  # the reply follows the grammar (unless cut by max_tokens: recorded as truncated)
        c = r.choices[0]
        if c.finish_reason == "length":
            continue
        if name == "json_schema":
            assert set(json.loads(c.message.content)) == {"answer", "sure"}
        elif name.startswith("tool_choice") or c.finish_reason == "tool_calls":
            assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "add"
            assert set(json.loads(c.message.tool_calls[0].function.arguments)) == {"a", "b"}
        elif name == "structured_outputs.choice":
            assert c.message.content in ("seven", "eight", "nine")
    trainer = GRPOTrainer(tiny_model_path, TrainConfig(device="cpu"))
    m = trainer.step(ts)
    print(f"{name}: logprob_gap {m['logprob_gap']:.2e}")
    assert m["num_constrained"] == 4 and m["constraint_mismatch"] == 0
    assert m["logprob_gap"] <= 1e-5
    # the same calls scored without the grammar: far from what the server sampled from
    plain = [t.__class__(**{**t.__dict__, "constraint": None}) for t in ts]
    unmasked = GRPOTrainer(tiny_model_path, TrainConfig(device="cpu")).step(plain)
    print(f"{name}: unmasked logprob_gap {unmasked['logprob_gap']:.2e}")
    if name != "tools.auto":  # text that never begins a call is the model's own, masked or not
        assert unmasked["logprob_gap"] > 1e-2


def test_a_stored_forced_call_replays_under_the_grammar_it_was_sampled_under(tiny_model_path):
    """A tool_calls spec without `choice` (stores written before every request with tools was constrained as vLLM
    constrains it): the compact grammar the built-in server sampled such calls under, still replayed; the spec of
    today takes the call with the template's newlines or without them, its arguments with free whitespace."""
    from lightning_sdk import models
    from lightning_sdk.constraint import from_request
    from lightning_sdk.grammar import Grammars

    tok = models.load_tokenizer(tiny_model_path)
    model = models.load_causal_lm(tiny_model_path)
    grammars = Grammars(tok, int(model.get_output_embeddings().weight.shape[0]), models.eos_ids(model, tok))
    stored = Constraint.from_json('{"kind":"tool_calls","spec":{"tools":[{"name":"add","parameters":'
                                  + json.dumps(TOOLS[0]["function"]["parameters"]) + '}],"one":true},'
                                  '"param":"tool_choice"}')
    today = from_request({"tools": TOOLS, "tool_choice": "required"})
    eos = sorted(models.eos_ids(model, tok))[:1]

    def ids(text):
        return tok.encode(text, add_special_tokens=False) + eos

    compact = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    loose = '<tool_call>{"name": "add", "arguments": {\n  "a":1,\n  "b": 2\n}}</tool_call>'
    assert grammars.replay(stored, ids(compact)) is not None and grammars.replay(stored, ids(loose)) is None
    assert grammars.replay(today, ids(compact)) is not None and grammars.replay(today, ids(loose)) is not None
    grammars.close()


def test_ids_the_grammar_does_not_accept_are_left_out_and_counted(gw, store, tiny_model_path):
    _, ts = _calls(gw, store, CONSTRAINTS["json_schema"], k=2)
    other = Constraint("choice", ["x"], "structured_outputs.choice").to_json()
    ts = [ts[0], ts[1].__class__(**{**ts[1].__dict__, "constraint": other})]
    m = GRPOTrainer(tiny_model_path, TrainConfig(device="cpu")).step(ts)
    assert m["constraint_mismatch"] == 1 and m["num_constrained"] == 1


def test_lightning_check_names_the_constrained_calls():
    from collections import Counter

    from rich.console import Console

    from lightning_sdk.check import RolloutCheck, rollout_table
    from lightning_sdk import config

    row = dict(group_id="task 1", task_id="t1", status="succeeded", reward=1.0, error=None, where=None, calls=2, left_out=Counter(),
               components=(), call_error=None, transitions=2)
    label = Constraint("json_schema", {"title": "Answer", "type": "object"}, "response_format.json_schema.schema").label
    console = Console(width=200, record=True)
    console.print(rollout_table([RolloutCheck(rollout_id="check-000-0-ab", constrained=(label, label), **row),
                          RolloutCheck(rollout_id="check-000-1-cd", **row)], config.load(Path(__file__).parents[1] / "cookbook/extract/lightning.toml")))
    out = console.export_text()
    assert "2 (2 constrained: json_schema Answer)" in out and out.count("constrained") == 1


BAD_TOOL_CALLS = [  # stored records are untrusted: each of these is left out and counted, never stops the step
    {"kind": "tool_calls", "spec": {"tools": [1], "one": True, "choice": "required"},
     "server": {"tool_parser": "llama3_json", "reasoning_parser": None, "compact": False}},
    {"kind": "tool_calls", "spec": {"one": True, "choice": "required"},
     "server": {"tool_parser": "mistral", "reasoning_parser": None, "compact": False}},
    {"kind": "tool_calls", "spec": {"tools": [{"name": "add", "parameters": 3}], "one": True}},
    {"kind": "tool_calls", "spec": {"tools": [{"name": "add", "parameters": {}}], "one": "yes"}},
    {"kind": "tool_calls", "spec": {"tools": [{"name": "add", "parameters": {}}], "one": True, "choice": "some"}},
    {"kind": "tool_calls", "spec": {"tools": [{"name": "add", "parameters": {}}], "one": True, "choice": "auto",
                                    "text": {"kind": "tool_calls"}}},
]


@pytest.mark.parametrize("record", BAD_TOOL_CALLS, ids=range(len(BAD_TOOL_CALLS)))
def test_a_malformed_stored_tool_calls_record_is_refused_with_a_constraint_error(record):
    from lightning_sdk.constraint import ConstraintError

    with pytest.raises(ConstraintError, match="not a recorded tool_calls constraint"):
        Constraint.from_json(json.dumps(record))


def test_a_malformed_spec_reaching_the_compile_is_a_constraint_error(tiny_model_path):
    """Past from_json (a Constraint made in code), the compile path turns any error into a ConstraintError, in
    every tool format, the grammar-free ones' check included."""
    from lightning_sdk import models
    from lightning_sdk.constraint import TOOL_FORMATS, ConstraintError, ServerGrammar
    from lightning_sdk.grammar import Grammars

    tok = models.load_tokenizer(tiny_model_path)
    model = models.load_causal_lm(tiny_model_path)
    grammars = Grammars(tok, int(model.get_output_embeddings().weight.shape[0]), models.eos_ids(model, tok))
    for fmt in TOOL_FORMATS:
        for spec in ({"tools": [1], "one": True, "choice": "required"}, {"one": True, "choice": "required"}):
            c = Constraint("tool_calls", spec, "tool_choice", ServerGrammar(fmt, None, compact=False))
            with pytest.raises(ConstraintError):
                grammars.replay(c, [1, 2])
    grammars.close()


def test_a_malformed_stored_record_is_left_out_and_the_step_goes_on(gw, store, tiny_model_path):
    _, ts = _calls(gw, store, CONSTRAINTS["json_schema"], k=2)
    bad = json.dumps(BAD_TOOL_CALLS[0])
    ts = [ts[0], ts[1].__class__(**{**ts[1].__dict__, "constraint": bad})]
    m = GRPOTrainer(tiny_model_path, TrainConfig(device="cpu")).step(ts)
    assert m["constraint_mismatch"] == 1 and m["num_constrained"] == 1
