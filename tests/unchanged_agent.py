"""An agent as one writes it for OpenAI: its client built at import from the environment (which every runtime points
at the run's gateway), its own model name, no `llm` argument. tests/test_ray_runtime.py and tests/test_vllm_runs.py."""

from openai import AsyncOpenAI
import lightning_sdk as ls

client = AsyncOpenAI()  # at import, in the worker actor: from the environment the run set there

@ls.rollout
async def solve(task):
    out = await client.chat.completions.create(model="gpt-4o-mini", temperature=1.0, max_tokens=8,
                                               messages=[{"role": "user", "content": task["question"]}])
    return out.choices[0].message.content or ""

@ls.reward
def score(task, output):
    return float(output.strip() == task["answer"])
