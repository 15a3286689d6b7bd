"""Tool calls in chat completions: the parser on its own, then the real server through the real openai client.

The server tests use the calc cookbook's tiny model (`tiny:cookbook/calc/teacher.py`), which was taught to call
the calculator in the Qwen2.5 `<tool_call>` format, so tool calls come out of real sampling.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from lightning_sdk import models
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.engine.toolcalls import Reader, StreamShaper, ToolCallParser, message, parse, tool_format

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TEACHER = f"tiny:{ROOT / 'cookbook/calc/teacher.py'}"
SYSTEM = "Solve the problem. Use the calculator, then give the number."
QUESTION = "Ann has 12 boxes with 8 pencils in each. How many pencils does Ann have?"
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * / and parentheses, e.g. 12*3-5.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]


def test_parse_splits_content_and_calls():
    content, calls = parse('Let me see. <tool_call>\n{"name": "calc", "arguments": {"x": "1+2"}}\n</tool_call>')
    assert content == "Let me see."
    assert [c["function"] for c in calls] == [{"name": "calc", "arguments": '{"x": "1+2"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse("just text") == ("just text", [])
    # Not a call: stays content, word for word. An unterminated but complete call at the end still counts.
    assert parse("<tool_call>{oops}</tool_call> x") == ("<tool_call>{oops}</tool_call> x", [])
    content, calls = parse('<tool_call>{"name": "c", "arguments": "{\\"y\\": 2}"}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"y": 2}


def test_streamed_parse_equals_whole_parse():
    text = ('Hi <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> <tool')
    p, pieces = ToolCallParser(), []
    for ch in text:  # one character at a time: the worst case for held-back prefixes
        pieces.append(p.feed(ch)[0])
    pieces.append(p.finish()[0])
    content, calls = parse(text)
    assert "".join(pieces) == content == "Hi \n <tool"
    assert [c["function"] for c in p.calls] == [c["function"] for c in calls]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = models.resolve(TEACHER)
    with CPUServer(path, served_model_name="calc", threads=1, max_model_len=512,
                   log_path=tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(models.resolve(TEACHER))


def ask(client, **kw):
    return client.chat.completions.create(model="calc", messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], max_tokens=40, **kw)


def _streamed_one(shaper: StreamShaper, index: int, text: str, k: int, sent: dict) -> None:
    """The k-th character of `text` streamed as choice `index`, what it sent added to `sent`."""
    delta, _ = shaper.delta(index, text[k], "stop" if k == len(text) - 1 else None)
    sent["content"] += delta["content"]
    sent["reasoning"] += delta.get("reasoning_content", "")
    sent["calls"] += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])]


HARMONY_RM = ("<|channel|>analysis<|message|>clean up<|end|><|start|>assistant<|channel|>commentary to=functions.rm "
              "<|constrain|>json<|message|>{}<|call|>")


def test_gpt_oss_calls_are_not_read_when_the_request_parses_none():
    """tool_choice "none" or no tools: a harmony call message is dropped, as vLLM's harmony parser's caller drops
    it; the analysis channel is still the reasoning."""
    reader = Reader(tool_format("openai").without_calls())
    msg, finish = message(HARMONY_RM, "stop", reader)
    assert (msg["content"], msg["tool_calls"], msg["reasoning_content"], finish) == (None, [], "clean up", "stop")
    sent = {"content": "", "reasoning": "", "calls": []}
    shaper = StreamShaper(1, reader)
    for k in range(len(HARMONY_RM)):
        _streamed_one(shaper, 0, HARMONY_RM, k, sent)
    assert sent == {"content": "", "reasoning": "clean up", "calls": []}
    msg, finish = message(HARMONY_RM, "stop", Reader(tool_format("openai")))  # with calls parsed
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["rm"] and finish == "tool_calls"


def test_harmony_streams_of_one_request_read_as_their_whole_replies():
    """Two choices streamed interleaved through one reader (which keeps each stream's complete messages), one
    starting as the other does and parting mid-message (the first's message has no end marker): each adds up to
    its own whole reply."""
    a = ("<|channel|>final<|message|>one<|start|>assistant<|channel|>commentary to=functions.add "
         '<|constrain|>json<|message|>{"a": 1}<|call|><|start|>assistant<|channel|>final<|message|>two<|end|>')
    b = ("<|channel|>final<|message|>one, and more<|end|><|start|>assistant<|channel|>analysis<|message|>hm<|end|>"
         "<|start|>assistant<|channel|>final<|message|>three")
    reader = Reader(tool_format("openai"))
    shaper, sent = StreamShaper(2, reader), [{"content": "", "reasoning": "", "calls": []} for _ in range(2)]
    for k in range(max(len(a), len(b))):
        for i, text in enumerate((a, b)):
            if k < len(text):
                _streamed_one(shaper, i, text, k, sent[i])
    for text, got in zip((a, b), sent):
        whole, _ = message(text, "stop", Reader(tool_format("openai")))
        again, _ = message(text, "stop", reader)  # the reader that kept the streams' messages reads it alike
        assert (again["content"], again.get("reasoning_content"), len(again["tool_calls"])) == \
            (whole["content"], whole.get("reasoning_content"), len(whole["tool_calls"]))
        assert got["content"] == (whole["content"] or "") and got["reasoning"] == whole.get("reasoning_content", "")
        assert got["calls"] == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert sent[0]["content"] == "onetwo" and sent[0]["calls"] == [("add", '{"a": 1}')]
    assert sent[1] == {"content": "one, and morethree", "reasoning": "hm", "calls": []}


def test_server_returns_tool_calls_with_exact_token_ids(client, tokenizer):
    out = ask(client, tools=TOOLS, n=8, temperature=1.0, seed=1)
    called = [c for c in out.choices if c.message.tool_calls]
    assert called, [c.message.content for c in out.choices]  # the tiny model was taught to call the tool
    for c in out.choices:
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)  # what was sampled, unchanged
        content, calls = parse(text)
        assert c.message.content == content
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []] == \
               [(t["function"]["name"], t["function"]["arguments"]) for t in calls]
        assert c.finish_reason == ("tool_calls" if calls and c.finish_reason != "length" else c.finish_reason)
    call = called[0].message.tool_calls[0]
    assert call.function.name == "calculator" and "expression" in json.loads(call.function.arguments)
    assert called[0].finish_reason == "tool_calls"


def test_tool_choice_none_leaves_the_text_alone(client, tokenizer):
    out = ask(client, tools=TOOLS, tool_choice="none", n=4, seed=1)
    for c in out.choices:
        assert not c.message.tool_calls and c.finish_reason != "tool_calls"
        assert c.message.content == tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_streamed_tool_calls_match_the_plain_reply(client):
    plain = ask(client, tools=TOOLS, temperature=0)
    chunks = list(ask(client, tools=TOOLS, temperature=0, stream=True))
    ids = [i for ch in chunks for c in ch.choices for i in (c.model_extra.get("token_ids") or [])]
    assert ids == plain.choices[0].token_ids
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    calls = [t for ch in chunks for c in ch.choices for t in (c.delta.tool_calls or [])]
    assert (content or None) == plain.choices[0].message.content
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == \
           [(i, t.function.name, t.function.arguments) for i, t in enumerate(plain.choices[0].message.tool_calls)]
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finish == [plain.choices[0].finish_reason]


def test_tool_messages_are_rendered_into_the_prompt(client, tokenizer):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": "12*8"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "96"},
    ]
    out = client.chat.completions.create(model="calc", messages=messages, max_tokens=12, temperature=0)
    prompt = tokenizer.decode(out.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*8"}}\n</tool_call>' in prompt
    assert "<tool_response>\n96\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_bad_tool_requests_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="not in `tools`") as e:
        ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="needs at least one tool"):
        ask(client, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        ask(client, tools=[{"type": "function", "function": {"description": "no name"}}])
    bad_args = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError, match="arguments is not valid JSON") as e:
        client.chat.completions.create(model="calc", messages=bad_args, max_tokens=4)
    assert e.value.body["param"] == "messages.1.tool_calls.0.function.arguments"
