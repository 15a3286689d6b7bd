"""A two-role agent for the [policies] tests of the Ray and remote runtimes: a writer, a rewriter and a judge call per
rollout, each under its `ls.component`. Its client is built at import from the environment, as most OpenAI agents
are; both runtimes set OPENAI_BASE_URL / OPENAI_API_KEY to the run's gateway before importing it."""

from openai import AsyncOpenAI

import lightning_sdk as ls

client = AsyncOpenAI(max_retries=0)


async def ask(role: str, question: str) -> str:
    with ls.component(role):
        out = await client.chat.completions.create(model="gpt-4o-mini", temperature=1.0, max_tokens=8,
                                                   messages=[{"role": "user", "content": question}])
    return out.choices[0].message.content or ""


@ls.rollout
async def solve(task: dict) -> list:
    answers = [await ask("writer", task["question"]), await ask("rewriter", task["question"])]
    await ask("judge", task["question"])  # a component in no policy: served by the base model, never trained
    return answers


@ls.reward
def score(task: dict, answers: list) -> float:
    # Plus a little for length, so a group's rewards differ (a tiny model rarely answers right): with all equal,
    # the group carries no advantage and the adapters the tests look at would not move.
    return sum(a.strip() == task["answer"] for a in answers) / 2 + sum(len(a) for a in answers) / 1000
