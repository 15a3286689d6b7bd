"""The real families' small models (models.families): each loads like a hub checkpoint, keeps what sets its
architecture apart, renders its family's documented chat format, and trains a LoRA and a QLoRA (nf4 through
bitsandbytes on the CPU) step on the modules found for its architecture."""

from __future__ import annotations

import pytest
import torch

from lightning_sdk import models
from lightning_sdk.config import TrainConfig
from lightning_sdk.models import families
from lightning_sdk.models.tool_parsers import model_files, reasoning_parser_for, tool_call_parser_for
from lightning_sdk.train.trainer import GRPOTrainer, lora_targets
from lightning_sdk.transitions import Transition

torch.set_num_threads(1)  # the machine is shared

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = {"id": "call00001", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*8"}}}
# A tool round trip: the question, a call (with reasoning), its result, the answer (with reasoning), a new question.
CHAT = [{"role": "system", "content": "Solve the problem."},
        {"role": "user", "content": "How many pencils are in 12 boxes of 8?"},
        {"role": "assistant", "content": "", "reasoning_content": "multiply them", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "name": "calculator", "content": "96"},
        {"role": "assistant", "content": "There are 96.", "reasoning_content": "the tool said 96"},
        {"role": "user", "content": "And in 3 boxes?"}]
LATER = CHAT[:4]  # the call and its result after the last question: its reasoning stays in a thinking template

# family -> (what the rendered tool round trip holds, in order: how tools are offered, the call, the result, the
# generation prompt).
FORMAT = {
    "qwen2.5": ["<|im_start|>system\nSolve the problem.\n\n# Tools", "<tools>\n{\"type\": \"function\"",
                "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*8\"}}\n</tool_call>"
                "<|im_end|>", "<|im_start|>user\n<tool_response>\n96\n</tool_response><|im_end|>",
                "<|im_start|>assistant\n"],
    "qwen3": ["<|im_start|>system\nSolve the problem.\n\n# Tools", "<tools>\n{\"type\": \"function\"",
              "<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": "
              "\"12*8\"}}\n</tool_call>", "<tool_response>\n96\n</tool_response>",
              "<|im_start|>assistant\nThere are 96.<|im_end|>", "<|im_start|>assistant\n"],
    "llama3": ["<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n",
               "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions",
               "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"calculator\", \"parameters\": "
               "{\"expression\": \"12*8\"}}<|eot_id|>",
               "<|start_header_id|>ipython<|end_header_id|>\n\n\"96\"<|eot_id|>",
               "<|start_header_id|>assistant<|end_header_id|>\n\n"],
    "mistral": ["<s>[INST] How many", "[TOOL_CALLS] [{\"name\": \"calculator\", \"arguments\": {\"expression\": "
                "\"12*8\"}, \"id\": \"call00001\"}]</s>", "[TOOL_RESULTS] {\"content\": 96, \"call_id\": \"call00001\"}"
                "[/TOOL_RESULTS]",
                "[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": {\"name\": \"calculator\"",
                "[/AVAILABLE_TOOLS][INST] Solve the problem.\n\nAnd in 3 boxes?[/INST]"],
    "gpt-oss": ["<|start|>system<|message|>You are ChatGPT", "Calls to these tools must go to the commentary channel",
                "<|start|>developer<|message|># Instructions\n\nSolve the problem.\n\n# Tools\n\n## functions\n\n"
                "namespace functions {\n\n// Evaluate an arithmetic expression.\ntype calculator = (_: {\n"
                "expression: string,\n}) => any;", "<|start|>assistant to=functions.calculator<|channel|>commentary "
                "json<|message|>{\"expression\": \"12*8\"}<|call|>", "<|start|>functions.calculator to=assistant"
                "<|channel|>commentary<|message|>96<|end|>", "<|start|>assistant<|channel|>final<|message|>There are "
                "96.<|end|>", "<|start|>user<|message|>And in 3 boxes?<|end|><|start|>assistant"],
    "gemma3": ["<bos><start_of_turn>user\nSolve the problem.\n\nTools (functions) are available.",
               "How many pencils are in 12 boxes of 8?<end_of_turn>\n", "<start_of_turn>model\n"
               "[calculator(expression=\"12*8\")]<end_of_turn>\n", "<start_of_turn>user\n```tool_output\n96\n```"
               "<end_of_turn>\n", "<start_of_turn>model\n"],
}
# family -> (tool-call parser, reasoning parser) vLLM is started with for it.
PARSERS = {"qwen2.5": ("hermes", None), "qwen3": ("hermes", "qwen3"), "llama3": ("llama3_json", None),
           "mistral": ("mistral", None), "gemma3": ("pythonic", None), "gpt-oss": ("openai", "openai_gptoss")}
MLP = {"gate_proj", "up_proj", "down_proj"}
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.fixture(scope="module", params=sorted(families.FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(family) -> str:
    return models.resolve(f"family:{family}")


def test_every_family_is_checked():
    assert set(FORMAT) == set(PARSERS) == set(families.FAMILIES)


def test_each_family_loads_like_a_hub_model_with_its_architecture(family, path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    names = {n for n, _ in model.named_parameters()}
    c = model.config
    assert c.head_dim == 64 and c.num_hidden_layers == 2 and c.vocab_size == len(tok)
    layer = "model.layers.0."
    distinct = {  # what sets each architecture apart, present in the weights
        "qwen2.5": {layer + "self_attn.q_proj.bias"},  # Qwen2's biased q/k/v
        "qwen3": {layer + "self_attn.q_norm.weight", layer + "self_attn.k_norm.weight"},
        "llama3": set(),
        "mistral": set(),
        "gpt-oss": {layer + "self_attn.sinks", layer + "mlp.router.weight", layer + "mlp.experts.gate_up_proj"},
        "gemma3": {layer + "pre_feedforward_layernorm.weight", layer + "post_feedforward_layernorm.weight",
                   layer + "self_attn.q_norm.weight"},
    }[family]
    assert distinct <= names
    if family in ("gpt-oss", "gemma3"):
        assert c.layer_types == ["sliding_attention", "full_attention"] and c.sliding_window == families.WINDOW
    if family == "llama3":
        assert c.rope_parameters["rope_type"] == "llama3"
    stops = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids(families.FAMILIES[family].chat.eos) in stops
    ids = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    assert model(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), len(tok))


def test_each_family_renders_its_documented_format(family, path):
    tok = models.load_tokenizer(path)
    text = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    at = 0
    for part in FORMAT[family]:  # each part, in order
        found = text.find(part, at)
        assert found >= 0, (part, text[at:])
        at = found + len(part)
    assert text.endswith(FORMAT[family][-1])
    ids = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE: the ids are the text
    chat = families.FAMILIES[family].chat
    for token in chat.special + chat.plain:  # each of the format's tokens is one token
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1, token
    # the parsers vLLM is started with, read from the model's files as a run reads them
    assert (tool_call_parser_for(*model_files(path)), reasoning_parser_for(*model_files(path))) == PARSERS[family]


def test_thinking_is_dropped_from_past_turns_and_kept_after_the_last_question(family, path):
    tok = models.load_tokenizer(path)
    past = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    current = tok.apply_chat_template(LATER, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "multiply them" not in past and "the tool said 96" not in past
    kept = {"qwen3": "<|im_start|>assistant\n<think>\nmultiply them\n</think>\n\n<tool_call>",
            "gpt-oss": "<|start|>assistant<|channel|>analysis<|message|>multiply them<|end|>"}
    if family in kept:
        assert kept[family] in current
        plain = tok.apply_chat_template([CHAT[1]], add_generation_prompt=True, tokenize=False,
                                        enable_thinking=False)
        if family == "qwen3":  # thinking off: the reply opens with an empty think block
            assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:  # the other families have no reasoning in their format
        assert "multiply them" not in current


def test_mistral_tool_call_ids_are_nine_characters(path, family):
    if family != "mistral":
        pytest.skip("Mistral's format alone checks call ids")
    tok = models.load_tokenizer(path)
    bad = [dict(m, tool_call_id="call_1") if m["role"] == "tool" else m for m in CHAT]
    with pytest.raises(Exception, match="Tool call IDs should be alphanumeric strings with length 9"):
        tok.apply_chat_template(bad, tools=TOOLS, tokenize=False)


def transitions(path: str) -> list[Transition]:
    tok = models.load_tokenizer(path)
    prompt = tuple(tok.apply_chat_template(CHAT[:2], tools=TOOLS, add_generation_prompt=True)["input_ids"])
    replies = ["There are 96 pencils.", "I do not know."]
    return [Transition(rollout_id=f"r{k}", group_id="g", span_id=f"s{k}", index=0, component=None,
                       prompt_ids=prompt, completion_ids=tuple(tok(replies[k], add_special_tokens=False)["input_ids"]),
                       logprobs=None, reward=float(k == 0)) for k in range(2)]


@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_lora_and_qlora_train_a_step_on_the_family_s_modules(family, path, quantization):
    """all-linear finds each architecture's projections: attention and MLP, but gpt-oss's experts are not linear
    layers (one 3-d weight per projection), so its adapter holds the attention alone."""
    if quantization == "4bit":
        pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    base = models.load_causal_lm(path, dtype="float32", quantization=quantization)
    found = set(lora_targets(base, ["all-linear"]))
    trainer = GRPOTrainer(path, TrainConfig(lora_r=8, target_modules="all-linear", device="cpu", lr=1e-2),
                          quantization=quantization, dtype="float32")
    assert found == (ATTENTION if family == "gpt-oss" else ATTENTION | MLP)
    adapted = {n.split(".lora_A")[0].split(".")[-1] for n, _ in trainer.model.named_parameters() if "lora_A" in n}
    assert adapted == found
    if quantization == "4bit":
        linear4 = [m for m in trainer.model.modules() if type(m).__module__.startswith("bitsandbytes")
                   and type(m).__name__ == "Linear4bit"]
        assert len(linear4) == len(found) * 2  # every adapted projection of both layers is nf4
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.step(transitions(path))
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))


def test_a_4bit_base_keeps_its_gradient_after_a_frozen_pass():
    """bitsandbytes' CPU inference kernel (taken after a no-grad pass in eval mode, as the trainer's reference pass
    is) has no backward: the loaded base never switches to it, so gradients still flow through every nf4 layer."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
    model = models.load_causal_lm(models.resolve("family:llama3"), dtype="float32", quantization="4bit")
    layer = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        model.eval()(input_ids=torch.tensor([[1, 2, 3]]))
    x = torch.randn(1, 3, model.config.hidden_size, requires_grad=True)
    layer.train()(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
