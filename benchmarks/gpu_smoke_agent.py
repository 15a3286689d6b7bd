"""The GPU smoke test's agent: the arithmetic task with room for a longer reply, so collection moves real tokens.

The reward is the default task's (the bare, correct number); a real instruct model usually says more.
"""

import os

from openai import AsyncOpenAI

import lightning_sdk as ls

MAX_TOKENS = int(os.environ.get("SMOKE_MAX_TOKENS", "128"))


@ls.rollout
async def solve(task: dict, llm: ls.LLM) -> str:
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
        out = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["question"] + " Reply with the number."}],
            temperature=1.0, max_tokens=MAX_TOKENS)
    return out.choices[0].message.content or ""


@ls.reward
def score(task: dict, output: str) -> float:
    return float(output.strip() == task["answer"])
