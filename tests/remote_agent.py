"""The agent the remote-runtime tests train with workers: written as most OpenAI agents are (its client built at
import from the environment, its own model name, `fn(task)`), plus the two decorators. A task with "block" hangs
after its LLM call when REMOTE_AGENT_BLOCK=1 (a worker to kill mid-rollout); "sleep" waits that long after it."""

import asyncio
import os

from openai import AsyncOpenAI

import lightning_sdk as ls

client = AsyncOpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY: the worker sets them before this import
AT_IMPORT = os.environ.get("OPENAI_BASE_URL")


@ls.rollout
async def solve(task):
    out = await client.chat.completions.create(model="gpt-4o-mini", max_tokens=8, temperature=1.0,
                                               messages=[{"role": "user", "content": task["question"]}])
    if task.get("block") and os.environ.get("REMOTE_AGENT_BLOCK") == "1":
        await asyncio.sleep(3600)
    await asyncio.sleep(task.get("sleep", 0))
    return {"text": out.choices[0].message.content or "", "base_url": AT_IMPORT}


@ls.reward
def score(task, output):
    assert output["base_url"], "the worker did not set OPENAI_BASE_URL before importing the agent"
    return float(output["text"].strip() == task.get("answer"))
