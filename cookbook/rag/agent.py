"""Multi-hop QA over a local BM25 index: an ordinary OpenAI Agents SDK agent with one search tool.

The agent is built the way the Agents SDK documents for other providers: an `OpenAIChatCompletionsModel` over an
`AsyncOpenAI` client pointed at the runtime's server, SDK tracing off (it would upload to OpenAI), a
`function_tool` for search. It searches, reads, searches again or answers. The decorators are the only
lightning-sdk code.
"""

import json
import re
import string
from collections import Counter
from functools import cache
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI
from rank_bm25 import BM25Okapi

import lightning_sdk as ls

CORPUS = Path(__file__).parent / "data" / "corpus.jsonl"
set_tracing_disabled(True)
INSTRUCTIONS = "Answer with the region name only. Search for the person, then for their town's region."


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@cache
def _index() -> tuple[list[str], BM25Okapi]:
    passages = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    return passages, BM25Okapi([_tokens(p) for p in passages])


def retrieve(query: str, k: int = 2) -> list[str]:
    passages, bm25 = _index()
    scores = bm25.get_scores(_tokens(query))
    best = sorted(range(len(passages)), key=lambda i: -scores[i])[:k]
    return [passages[i] for i in best if scores[i] > 0]


def search_passages(query: str) -> str:
    return "\n".join(retrieve(query)) or "no match"


@function_tool
def search(query: str) -> str:
    """Search the encyclopedia; returns the best matching passages."""
    return search_passages(query)


@ls.rollout
async def answer(task: dict, llm: ls.LLM) -> str:
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    agent = Agent(
        name="researcher",
        instructions=INSTRUCTIONS,
        tools=[search],
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
        model_settings=ModelSettings(temperature=1.0, max_tokens=64),
    )
    try:
        result = await Runner.run(agent, task["question"], max_turns=4)
        return str(result.final_output or "")
    except MaxTurnsExceeded:
        return ""  # searched until the turn limit without answering
    finally:
        await client.close()


def _normalise(text: str) -> list[str]:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return [w for w in text.split() if w not in ("a", "an", "the", "region", "of")]


def f1(prediction: str, gold: str) -> float:
    pred, ref = _normalise(prediction), _normalise(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


@ls.reward
def score(task: dict, output: str) -> float:
    """Token F1 of the answer against the gold region (exact match scores 1)."""
    return f1(output, task["answer"])
