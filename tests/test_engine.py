"""Continuous batching in the engine itself (no HTTP): requests that arrive while a batch decodes join it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lightning_sdk import models
from lightning_sdk.engine.engine import Engine, GenerationRequest

torch.set_num_threads(1)  # the machine is shared


@pytest.fixture(scope="module")
def engine():
    e = Engine(models.resolve("builtin:tiny-arith"), dtype="float32", max_batch_size=32, max_model_len=256)
    yield e
    e.close()


def prompt(engine: Engine, a: int, b: int, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"What is {a} + {b}?"}]
    return engine.encode_chat(messages)


def newcomers(engine: Engine) -> list[GenerationRequest]:
    # Seeded samples, greedy, n > 1, a stop string, and prompts both shorter and longer than the running rows'
    # cache, so the merge pads either side.
    long_system = "You add two digits and answer with the number only. " * 3
    return [
        GenerationRequest(prompt(engine, 1, 2), max_tokens=8, temperature=1.0, seed=11),
        GenerationRequest(prompt(engine, 3, 4), max_tokens=8, temperature=0.0),
        GenerationRequest(prompt(engine, 5, 6), max_tokens=8, temperature=1.0, seed=12, n=3, top_logprobs=2),
        GenerationRequest(prompt(engine, 7, 8, long_system), max_tokens=8, temperature=0.7, top_p=0.9, seed=13),
        GenerationRequest(prompt(engine, 2, 9), max_tokens=8, temperature=1.0, seed=14, stop=["."]),
    ]


def same(a, b) -> None:
    assert a.prompt_ids == b.prompt_ids and len(a.choices) == len(b.choices)
    for x, y in zip(a.choices, b.choices):
        assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        assert (x.top_logprobs is None) == (y.top_logprobs is None)


def test_requests_submitted_mid_decode_join_the_running_batch(engine):
    long = GenerationRequest(prompt(engine, 9, 9), max_tokens=100, temperature=1.0, seed=7, ignore_eos=True)
    reqs = newcomers(engine)

    async def alone():
        return [await engine.generate(r) for r in [long, *reqs]]

    async def together():
        before = dict(engine.stats)
        running = asyncio.ensure_future(engine.generate(long))
        while engine.stats["generated_tokens"] - before["generated_tokens"] < 5:  # the long one is decoding
            await asyncio.sleep(0.001)
        joined = await asyncio.gather(*(engine.generate(r) for r in reqs))
        long_was_running = not running.done()  # the newcomers did not wait for the long reply to finish
        return [await running, *joined], long_was_running, before

    reference = asyncio.run(alone())
    results, long_was_running, before = asyncio.run(together())
    after = engine.stats
    assert long_was_running
    assert after["batches"] - before["batches"] == 1  # one decode loop served all six requests
    assert after["joined"] - before["joined"] == len(reqs)
    assert after["max_batch_rows"] >= 1 + 3
    assert len(results[0].choices[0].token_ids) == 100  # ignore_eos: it ran to max_tokens
    for got, want in zip(results, reference):  # seeded and greedy replies are unchanged by batching
        same(got, want)


def test_seeded_replies_do_not_depend_on_the_batch(engine):
    reqs = newcomers(engine)

    async def one_by_one():
        return [await engine.generate(r) for r in reqs]

    async def all_at_once():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    first, batched, again = asyncio.run(one_by_one()), asyncio.run(all_at_once()), asyncio.run(one_by_one())
    for a, b, c in zip(first, batched, again):
        same(a, b)
        same(a, c)
