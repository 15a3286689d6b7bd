"""The built-in inference server, end to end: a real subprocess on 127.0.0.1 and the real openai client."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest
import torch

from lightning_sdk import models
from lightning_sdk.servers import InferenceServer, ServerError
from lightning_sdk.servers.cpu import CPUServer

torch.set_num_threads(1)  # the machine is shared

KEY = "test-key"
NAME = "policy"
MAX_MODEL_LEN = 256


def ask(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


@pytest.fixture(scope="module")
def server():
    with CPUServer("builtin:tiny-arith", served_model_name=NAME, api_key=KEY, threads=1,
                   max_model_len=MAX_MODEL_LEN, max_batch_size=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(models.resolve("builtin:tiny-arith"))


def check_choice(choice, tokenizer, *, truncated: bool = False) -> None:
    ids = choice.token_ids
    assert ids and all(isinstance(i, int) for i in ids)
    if not truncated:
        assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    lps = [t.logprob for t in choice.logprobs.content]
    assert len(lps) == len(ids)
    assert all(math.isfinite(x) and x <= 0 for x in lps)


def test_handle_is_an_inference_server(server):
    assert isinstance(server, InferenceServer)
    assert server.is_alive() and server.base_url.endswith("/v1")
    assert "Uvicorn running" in server.log_tail(50)


def test_completion_has_ids_and_logprobs(client, tokenizer):
    messages = ask(3, 4)
    r = client.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=3,
                                       max_tokens=8, extra_body={"return_token_ids": True, "unknown_field": 1})
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == NAME
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert r.prompt_token_ids == list(expected)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    check_choice(choice, tokenizer)
    assert choice.finish_reason == "stop" and choice.token_ids[-1] == tokenizer.eos_token_id
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert r.usage.prompt_tokens == len(expected) and r.usage.completion_tokens == len(choice.token_ids)


def test_content_parts_give_the_same_prompt(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 3 "}, {"type": "text", "text": "+ 4?"}]}]
    a = client.chat.completions.create(model=NAME, messages=parts, max_tokens=1)
    b = client.chat.completions.create(model=NAME, messages=ask(3, 4), max_tokens=1)
    assert a.prompt_token_ids == b.prompt_token_ids


def test_n_choices_and_length_limit(client, tokenizer):
    r = client.chat.completions.create(model=NAME, messages=ask(5, 6), n=3, logprobs=True, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        check_choice(c, tokenizer)
    r = client.chat.completions.create(model=NAME, messages=ask(5, 6), max_tokens=1, logprobs=True)
    (c,) = r.choices
    assert c.finish_reason == "length" and len(c.token_ids) == 1 and r.usage.completion_tokens == 1


def test_greedy_is_deterministic_and_stop_truncates(client, tokenizer):
    def greedy(a, b, **kw):
        return client.chat.completions.create(model=NAME, messages=ask(a, b), temperature=0, logprobs=True,
                                              max_tokens=8, **kw).choices[0]

    first, again = greedy(9, 9), greedy(9, 9)
    assert first.token_ids == again.token_ids
    assert [t.logprob for t in first.logprobs.content] == [t.logprob for t in again.logprobs.content]
    # A stop string inside the greedy answer cuts the text before it; the sampled ids stay as they were.
    a, b, answer = next((a, b, text) for a, b in [(9, 9), (8, 9), (9, 7), (8, 8), (7, 9), (6, 9)]
                        if len(text := greedy(a, b).message.content) >= 2)
    cut = greedy(a, b, stop=[answer[1:], "never"])
    assert cut.finish_reason == "stop" and cut.message.content == answer[:1]
    assert cut.model_extra["stop_reason"] == answer[1:]
    check_choice(cut, tokenizer, truncated=True)
    assert tokenizer.decode(cut.token_ids, skip_special_tokens=True).startswith(answer)
    streamed = client.chat.completions.create(model=NAME, messages=ask(a, b), temperature=0, max_tokens=8,
                                              stop=[answer[1:]], stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == answer[:1]
    # A tiny nucleus leaves only the most likely token: sampling at temperature 1 then equals greedy.
    nucleus = client.chat.completions.create(model=NAME, messages=ask(9, 9), top_p=1e-4, n=2, max_tokens=8)
    assert all(c.token_ids == first.token_ids for c in nucleus.choices)


def test_stream_matches_the_plain_reply(client, tokenizer):
    kw = dict(model=NAME, messages=ask(7, 8), temperature=1.0, seed=1234, max_tokens=8, logprobs=True, n=2)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == plain.prompt_token_ids
    ids: dict[int, list[int]] = {0: [], 1: []}
    text = {0: "", 1: ""}
    finish = {}
    for ch in chunks[:-1]:
        assert ch.object == "chat.completion.chunk"
        (c,) = ch.choices
        ids[c.index] += c.token_ids
        text[c.index] += c.delta.content or ""
        if c.token_ids:
            assert len(c.logprobs.content) == len(c.token_ids)
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    for c in plain.choices:  # same seed: the same samples, streamed or not
        assert ids[c.index] == c.token_ids and text[c.index] == c.message.content
        assert finish[c.index] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(v) for v in ids.values())


def test_concurrent_requests_are_batched(server, client):
    # Prompts of different lengths, so the batch is left-padded; batched greedy must equal one-at-a-time greedy.
    prompts = [([{"role": "system", "content": "Add."}] if i % 2 else []) + ask(i % 10, i // 2) for i in range(16)]
    kw = dict(model=NAME, temperature=0, max_tokens=8, logprobs=True)
    alone = [client.chat.completions.create(messages=m, **kw).choices[0] for m in prompts]
    stats = lambda: httpx.get(f"{server.url}/stats", headers={"Authorization": f"Bearer {KEY}"}).json()  # noqa: E731

    async def burst():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0) as ac:
            return await asyncio.gather(*[ac.chat.completions.create(messages=m, **kw) for m in prompts])

    # Whether requests sent together arrive while a batch runs depends on the machine's load: up to three bursts,
    # each one's replies equal to one-at-a-time's, until one is batched.
    for _ in range(3):
        before = stats()
        together = [r.choices[0] for r in asyncio.run(burst())]
        for a, t in zip(alone, together):
            assert t.token_ids == a.token_ids
            assert [x.logprob for x in t.logprobs.content] == pytest.approx([x.logprob for x in a.logprobs.content],
                                                                              abs=1e-4)
        after = stats()
        assert after["requests"] - before["requests"] == 16
        if after["batches"] - before["batches"] < 16:
            break
    assert after["batches"] - before["batches"] < 16 and after["max_batch_rows"] > 1


def test_lora_adapter_hot_swap(server, client, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = models.load_causal_lm(models.resolve("builtin:tiny-arith"))
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # lora_B starts at zero (a no-op adapter); perturb it so outputs change
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(tmp_path / "adapter")

    def greedy_logprobs(model: str) -> list[float]:
        r = client.chat.completions.create(model=model, messages=ask(2, 2), temperature=0, max_tokens=1,
                                           logprobs=True, top_logprobs=5)
        return [t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs]

    before = greedy_logprobs(NAME)
    server.load_adapter("tuned", str(tmp_path / "adapter"))
    assert {m.id for m in client.models.list()} == {NAME, "tuned"}
    tuned = greedy_logprobs("tuned")
    assert tuned != pytest.approx(before, abs=1e-3)
    assert greedy_logprobs(NAME) == pytest.approx(before, abs=1e-5)  # base name: adapter disabled
    with pytest.raises(ServerError, match="already been loaded"):
        server.load_adapter("tuned", str(tmp_path / "adapter"))
    server.unload_adapter("tuned")
    assert [m.id for m in client.models.list()] == [NAME]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tuned", messages=ask(2, 2), max_tokens=1)
    with pytest.raises(ServerError, match="404"):
        server.unload_adapter("tuned")
    with pytest.raises(ServerError, match="400"):
        server.load_adapter("broken", str(tmp_path / "missing"))


def test_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=ask(1, 1))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=NAME, messages=ask(1, 1), temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model=NAME, messages=ask(1, 1), max_tokens=MAX_MODEL_LEN)
    r = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": NAME, "messages": ask(1, 1), "n": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n" and r.json()["error"]["code"] == 400


def test_api_key_is_enforced(server):
    body = {"model": NAME, "messages": ask(1, 1), "max_tokens": 1}
    assert httpx.post(f"{server.base_url}/chat/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server.base_url}/chat/completions", json=body, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{server.base_url}/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # liveness stays open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
