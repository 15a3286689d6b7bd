"""Information extraction into a pydantic model: the openai client's `chat.completions.parse`, as its users write
it, with `response_format=Person`.

The server samples the reply under the JSON schema of `Person` (constrained decoding), so the reply always parses;
what RL changes is which values the model puts in it. The trainer scores each token under the same grammar
(docs: structured outputs). The decorators are the only lightning-sdk code.
"""

from typing import Literal

from openai import AsyncOpenAI
from pydantic import BaseModel, Field

import lightning_sdk as ls

NAMES = ("Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana")
CITIES = ("Paris", "Oslo", "Rome", "Lima", "Cairo", "Tokyo", "Quito", "Seoul")
SYSTEM_MESSAGE = "Extract the person: their name, their age and the city they live in now."
FIELDS = ("name", "age", "city")


class Person(BaseModel):
    name: Literal[NAMES]
    age: int = Field(ge=18, le=99)
    city: Literal[CITIES]


@ls.rollout
async def extract(task: dict, llm: ls.LLM) -> dict:
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    try:
        out = await client.chat.completions.parse(
            model=llm.model, response_format=Person, temperature=1.0, max_tokens=48,
            messages=[{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": task["text"]}])
    finally:
        await client.close()
    return out.choices[0].message.parsed.model_dump()


@ls.reward
def score(task: dict, output: dict) -> float:
    """The share of the fields extracted right."""
    return sum(output.get(k) == task[k] for k in FIELDS) / len(FIELDS)
