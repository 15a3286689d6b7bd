"""Many concurrent writers, nothing lost: 50 rollouts x 20 real LLM calls through the gateway (which records each)
to the server, half from sync agents (each in its own thread) and half from async ones, with their reward spans,
then count what SQLite holds.
"""

from __future__ import annotations

import asyncio
import threading

import openai

import lightning_sdk as ls
from lightning_sdk import tracing
from lightning_sdk.tracing import COMPLETION_IDS, REWARD_SPAN
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.job import RolloutJob

from .conftest import SERVED

ROLLOUTS, CALLS = 50, 20


def test_50_concurrent_rollouts_x_20_calls_lose_no_span(gw, store):
    made = {"calls": 0, "rewards": 0}
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            made[key] += 1

    def ask(i: int) -> list[dict]:
        return [{"role": "user", "content": f"What is {i % 10} + {i // 10 % 10}?"}]

    @ls.rollout
    def sync_agent(task, llm):
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
        for i in range(CALLS):
            client.chat.completions.create(model=llm.model, messages=ask(i), max_tokens=1)
            count("calls")
            if i % 5 == 4:
                ls.emit_reward(0.1)
                count("rewards")
        client.close()
        return "done"

    @ls.rollout
    async def async_agent(task, llm):
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            for i in range(CALLS):
                await client.chat.completions.create(model=llm.model, messages=ask(i), max_tokens=1)
                count("calls")
                if i % 5 == 4:
                    ls.emit_reward(0.1)
                    count("rewards")
        return "done"

    @ls.reward
    def score(task, output):
        return float(output == "done")

    llm = ls.LLM(base_url=gw.base_url, api_key=gw.api_key, model=SERVED)
    jobs = [RolloutJob(rollout_id=f"load-{k:02d}", task_id=f"t{k}", group_id=f"0:{k}", task={}, iteration=0)
            for k in range(ROLLOUTS)]
    for j in jobs:
        gw.rollouts.open(j.trace_id, j.rollout_id)

    async def phase():
        return await asyncio.gather(*(run_rollout(j, rollout_fn=sync_agent if k % 2 else async_agent,
                                                  reward_fn=score, llm=llm, store=store, timeout=300)
                                      for k, j in enumerate(jobs)))

    results = asyncio.run(phase())
    assert gw.capture.flush()
    tracing.flush()
    assert tracing.writer_errors() == [] and gw.capture.errors == []
    assert [r.status for r in results] == ["succeeded"] * ROLLOUTS, [r.error for r in results if r.error]
    assert made == {"calls": ROLLOUTS * CALLS, "rewards": ROLLOUTS * CALLS // 5}

    llm_spans = sum(store.call_counts([j.rollout_id for j in jobs]).values())
    reward_spans = sum(s.name == REWARD_SPAN for j in jobs for s in store.spans(j.rollout_id))
    intermediate = store.count("rewards") - ROLLOUTS  # the view holds each rollout's final reward too
    lost = made["calls"] - llm_spans
    print(f"store load: {made['calls']} LLM calls made, {llm_spans} spans stored, {lost} lost; "
          f"{made['rewards']} emit_reward, {reward_spans} reward spans, {intermediate} reward rows")
    assert lost == 0 and llm_spans == ROLLOUTS * CALLS
    assert reward_spans == intermediate == made["rewards"]
    for j in jobs:  # every stored call has its exact token ids, and each rollout has all 20 of its own calls
        spans = [s for s in store.spans(j.rollout_id) if tracing.is_llm_call(s)]
        assert len(spans) == CALLS and all(s.attributes.get(COMPLETION_IDS) for s in spans)
