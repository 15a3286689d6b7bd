"""A DSPy ReAct agent with one tool, as DSPy's documentation writes one: `dspy.ReAct` over a signature, DSPy's
default adapters (its ChatAdapter, which falls back to its JSONAdapter), an `dspy.LM` on an OpenAI-compatible
endpoint. The decorators are the only lightning-sdk code; the run points the LM at its gateway (OPENAI_BASE_URL).
"""

import dspy

import lightning_sdk as ls

dspy.configure(lm=dspy.LM("openai/gpt-4o-mini", temperature=1.0, max_tokens=64, num_retries=0))


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


react = dspy.ReAct("question -> answer: int", tools=[add], max_iters=3)


@ls.rollout
def solve(task: dict) -> int:
    return react(question=task["question"]).answer


@ls.reward
def score(task: dict, output: int) -> float:
    return float(output == task["answer"])
