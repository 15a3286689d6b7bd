"""Test agent for tests/test_ray_runtime.py: the arith agent, but one rollout of a 'victim' task stops after its
LLM call (its span shipped) and waits to be killed, after naming its worker actor in a marker file."""

import asyncio
import os

import ray
from openai import AsyncOpenAI

import lightning_sdk as ls
from lightning_sdk import tracing


@ls.rollout
async def solve(task: dict, llm: ls.LLM) -> str:
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
        out = await client.chat.completions.create(model=llm.model, temperature=1.0, max_tokens=8,
                                                   messages=[{"role": "user", "content": task["question"]}])
    await asyncio.to_thread(tracing.flush)  # the span has reached the store: now count the call
    rollout = tracing.current_rollout()
    with open(os.environ["LS_TEST_CALLS"], "a") as f:
        f.write(rollout.rollout_id + "\n")
    if task.get("victim") and rollout.attempt == 1:
        try:
            fd = os.open(os.environ["LS_TEST_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, f"{ray.get_runtime_context().get_actor_name()}\n{rollout.rollout_id}".encode())
            os.close(fd)
            await asyncio.sleep(600)  # killed long before this
    return out.choices[0].message.content or ""


@ls.reward
def score(task: dict, output: str) -> float:
    return float(output.strip() == task["answer"])
