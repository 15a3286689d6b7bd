"""The record says how the backend applied a call's constraint (constraint.ServerGrammar: its tool-call parser,
its reasoning parser, compact or free-whitespace tool-call arguments), and the trainer replays that: an explicit
serve.tool_call_parser reaches the built-in server's sampling and the replay, and records that do not say (older
stores) replay as they did. Real built-in server on 127.0.0.1 behind the gateway, SQLite, one GRPO step."""

from __future__ import annotations

import json

import openai
import torch

from lightning_sdk import models, tracing
from lightning_sdk.config import Config, TrainConfig
from lightning_sdk.constraint import Constraint, ServerGrammar, from_request
from lightning_sdk.grammar import Grammars
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.servers.select import one_server
from lightning_sdk.servers.vllm import VLLMServer
from lightning_sdk.train.trainer import GRPOTrainer
from lightning_sdk.transitions import to_transitions

from .conftest import SERVED, gateway_in_front_of, in_rollout

torch.set_num_threads(1)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "add"}}


def test_each_backend_says_what_it_applies(tmp_path):
    """One definition from the config: the built-in server gets serve.tool_call_parser / serve.reasoning_parser on
    its command line and samples compact arguments; vLLM the same parsers, free whitespace."""
    llama = models.resolve("family:llama3")  # its template says llama3_json
    cfg = Config.model_validate({"data": {"train": "t.jsonl"}, "agent": {"module": "agent.py"},
                                 "model": {"name": "family:llama3"}, "serve": {
        "backend": "cpu", "tool_call_parser": "hermes", "reasoning_parser": "none"}})
    server = one_server(cfg, llama, tmp_path / "server.log", "key")
    assert isinstance(server, CPUServer)
    cmd = server.command()
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes" and cmd[cmd.index("--reasoning-parser") + 1] == "none"
    assert server.grammar == ServerGrammar("hermes", None, compact=True)
    auto = CPUServer(llama, served_model_name="p")
    assert auto.grammar == ServerGrammar("llama3_json", None, compact=True)
    qwen3 = CPUServer(models.resolve("family:qwen3"), served_model_name="p")
    assert qwen3.grammar == ServerGrammar("hermes", "qwen3", compact=True)
    vllm = VLLMServer(llama, served_model_name="p", lora_r=8, tool_call_parser="hermes")
    assert vllm.grammar == ServerGrammar("hermes", None, compact=False)


def test_an_explicit_tool_call_parser_reaches_the_built_in_server_and_the_replay(tmp_path, store):
    """family:llama3 (whose template says llama3_json) served with serve.tool_call_parser = "hermes": forced calls
    are sampled as hermes `<tool_call>` blocks with compact arguments, read back as calls, recorded with the
    parser, and replayed in it (no mismatch, log-probs equal). The same records without what the server applied
    (an older store's form) replay as the run's backend applied them then: the built-in server hermes (kept), vLLM
    the detected llama3_json (all left out)."""
    path = models.resolve("family:llama3")
    with CPUServer(path, served_model_name=SERVED, threads=1, max_model_len=2048, tool_call_parser="hermes",
                   log_path=tmp_path / "server.log") as server, gateway_in_front_of(server) as gw:
        gw.capture.record_to(store)
        tracing.install(store, gateway_url=gw.base_url)
        client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
        replies = []
        try:
            for i in range(4):
                store.start_rollout(f"r{i}", task_id="t", group_id="g", iteration=0, phase="train")
                with in_rollout(gw, f"r{i}"):
                    replies.append(client.chat.completions.create(
                        model=SERVED, seed=i, max_tokens=64, temperature=1.0, tools=TOOLS, tool_choice=NAMED,
                        messages=[{"role": "user", "content": f"What is {i} + 4?"}],
                        extra_body={"return_token_ids": True}))
                store.finish_rollout(f"r{i}", status="succeeded", output="", reward=float(i % 2))
            assert gw.capture.flush()
            tracing.flush()
        finally:
            gw.capture.record_to(None)
    tok = models.load_tokenizer(path)
    read = 0
    for r in replies:
        c = r.choices[0]
        text = tok.decode(c.model_extra["token_ids"], skip_special_tokens=True)
        assert text.startswith('<tool_call>\n{"name": "add", "arguments": {"a": ') or \
            text.startswith('<tool_call>{"name": "add", "arguments": {"a": '), text
        if c.finish_reason == "tool_calls":
            read += 1
            args = c.message.tool_calls[0].function.arguments
            assert set(json.loads(args)) == {"a", "b"} and "\n" not in text.split('"arguments": ')[1].split("}")[0]
    assert read >= 1, [r.choices[0].finish_reason for r in replies]
    ts = [t for i in range(4) for t in to_transitions(store.rollout(f"r{i}"), store.spans(f"r{i}"))]
    assert len(ts) == 4
    assert all(json.loads(t.constraint)["server"] == {"tool_parser": "hermes", "reasoning_parser": None,
                                                      "compact": True} for t in ts)
    m = GRPOTrainer(path, TrainConfig(device="cpu", lora_r=4)).step(ts)
    print(f"explicit hermes on family:llama3: logprob_gap {m['logprob_gap']:.2e}, mismatch {m['constraint_mismatch']}")
    assert m["num_constrained"] == 4 and m["constraint_mismatch"] == 0 and m["logprob_gap"] <= 1e-5
    unsaid = [t.__class__(**{**t.__dict__, "constraint": json.dumps(
        {k: v for k, v in json.loads(t.constraint).items() if k != "server"})}) for t in ts]
    old = GRPOTrainer(path, TrainConfig(device="cpu", lora_r=4)).step(unsaid)
    # kept, though replayed with free whitespace as that server then sampled (this server's were compact: a gap)
    assert old["num_constrained"] == 4 and old["constraint_mismatch"] == 0
    on_vllm = GRPOTrainer(path, TrainConfig(device="cpu", lora_r=4), backend="vllm").step(unsaid)
    assert on_vllm["constraint_mismatch"] == 4


def test_an_old_built_in_store_of_a_reasoning_model_replays_from_the_first_token():
    """family:qwen3, a json_object record without `server` (the built-in server then masked from the first token,
    no reasoning parser): a completion that is not JSON and never ends a thinking is left out on the built-in
    backend; on vLLM (its qwen3 reasoning parser: no grammar before </think>) it is kept."""
    from lightning_sdk.transitions import Transition

    path = models.resolve("family:qwen3")
    tok = models.load_tokenizer(path)
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                           add_generation_prompt=True, enable_thinking=True, return_dict=False))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    record = json.dumps({"kind": "json_object", "spec": None, "param": "response_format"})
    texts = ['{"a":1}', '{"b":2}', "not json at all"]
    ts = [Transition(f"r{i}", "g", f"s{i}", 0, None, prompt, tuple(tok.encode(text, add_special_tokens=False)) + (eos,),
                     None, float(i % 2), constraint=record) for i, text in enumerate(texts)]
    built_in = GRPOTrainer(path, TrainConfig(device="cpu", lora_r=4)).step(ts)
    assert built_in["num_constrained"] == 2 and built_in["constraint_mismatch"] == 1
    on_vllm = GRPOTrainer(path, TrainConfig(device="cpu", lora_r=4), backend="vllm").step(ts)
    assert on_vllm["num_constrained"] == 3 and on_vllm["constraint_mismatch"] == 0


def test_records_that_do_not_say_replay_as_before(tiny_model_path):
    """A recorded tool_calls spec without `server` (an older store) replays as it did: free whitespace in the
    arguments, the format read from the model; with `server` compact, only json.dumps' separators; `from_json` and
    `to_json` keep `server`, and a malformed one is refused (the call left out, not trained wrong)."""
    tok = models.load_tokenizer(tiny_model_path)
    model = models.load_causal_lm(tiny_model_path)
    grammars = Grammars(tok, int(model.get_output_embeddings().weight.shape[0]), models.eos_ids(model, tok))
    eos = sorted(models.eos_ids(model, tok))[:1]

    def ids(text):
        return tok.encode(text, add_special_tokens=False) + eos

    request = from_request({"tools": TOOLS, "tool_choice": NAMED})
    old = Constraint.from_json(request.to_json())
    assert old.server is None and '"server"' not in old.to_json()
    built_in = Constraint.from_json(Constraint(request.kind, request.spec, request.param,
                                               ServerGrammar("hermes", None, compact=True)).to_json())
    assert built_in.server == ServerGrammar("hermes", None, compact=True)
    compact = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    loose = '<tool_call>{"name": "add", "arguments": {\n  "a":1,\n  "b": 2\n}}</tool_call>'
    assert grammars.replay(old, ids(compact)) is not None and grammars.replay(old, ids(loose)) is not None
    assert grammars.replay(built_in, ids(compact)) is not None and grammars.replay(built_in, ids(loose)) is None
    vllm = Constraint(request.kind, request.spec, request.param, ServerGrammar("hermes", None, compact=False))
    assert grammars.replay(vllm, ids(loose)) is not None
    try:
        Constraint.from_json(json.dumps({**json.loads(request.to_json()), "server": {"tool_parser": "hermes"}}))
    except ValueError as e:
        assert "server grammar" in str(e)
    else:
        raise AssertionError("a malformed server grammar was read")
    grammars.close()
