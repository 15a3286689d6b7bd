"""The default example: an agent that answers addition questions with one chat call.

It is an ordinary OpenAI-client agent; the two decorators are the only lightning-sdk code in it.
"""

from openai import AsyncOpenAI

import lightning_sdk as ls


@ls.rollout
async def solve(task: dict, llm: ls.LLM) -> str:
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
        out = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["question"]}],
            temperature=1.0,
            max_tokens=8,
        )
    return out.choices[0].message.content or ""


@ls.reward
def score(task: dict, output: str) -> float:
    return float(output.strip() == task["answer"])
