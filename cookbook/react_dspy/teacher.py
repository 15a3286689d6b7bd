"""The teacher behind the react_dspy example's `model = "tiny:teacher.py"`.

It runs the agent's own `dspy.ReAct` (agent.py) with DSPy's default ChatAdapter, over a scripted LM that answers
each of ReAct's calls in that adapter's field format (`[[ ## next_thought ## ]]`, `[[ ## next_tool_name ## ]]`,
`[[ ## next_tool_args ## ]]`, then the extract step's `[[ ## reasoning ## ]]` and `[[ ## answer ## ]]`): the
model learns the exact prompts DSPy sends and the replies its parser reads. It answers like a lazy student who
knows the `add` tool: about half of the time it calls `add` with the question's numbers, then finishes and
reports the tool's result; otherwise it finishes at once and answers with a number from the question (never the
sum). The untrained model then scores about half, and RL lifts it by making the tool call a habit (like the calc
example's teacher). A real instruct model needs none of this.
"""

import hashlib
import json
import random
import re
from pathlib import Path

import dspy
from litellm import ModelResponse

from lightning_sdk.files import load_py_file
from lightning_sdk.models import tiny

HERE = Path(__file__).parent
agent, make_data = (load_py_file(HERE / f"{m}.py", f"react_dspy_{m}") for m in ("agent", "make_data"))
USE_TOOL = 0.5  # how often the teacher calls the tool instead of guessing
RECIPE = ("make_data.py", "data/test.jsonl")
HELD_OUT = {json.loads(line)["question"] for line in (HERE / "data" / "test.jsonl").read_text().splitlines()}


def fields(**values) -> str:
    """A reply in the ChatAdapter's format: each output field under its header, then the completed marker."""
    return "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in values.items()) + "[[ ## completed ## ]]"


class Scripted(dspy.BaseLM):
    """Answers ReAct's calls with `replies` in turn and keeps each (messages, reply) pair."""

    def __init__(self, replies: list[str]):
        super().__init__(model="teacher", cache=False)
        self.replies, self.calls = list(replies), []

    def forward(self, prompt=None, messages=None, **kwargs):
        reply = self.replies.pop(0)
        self.calls.append((messages, reply))
        return ModelResponse(choices=[{"message": {"role": "assistant", "content": reply}}], model="teacher")


def episode(rng: random.Random, question: str) -> list[tuple[list[dict], str]]:
    a, b = (int(x) for x in re.findall(r"\d", question))
    if rng.random() < USE_TOOL:
        replies = [fields(next_thought="I add the numbers.", next_tool_name="add", next_tool_args=json.dumps({"a": a, "b": b})),
                   fields(next_thought="I have the sum.", next_tool_name="finish", next_tool_args="{}"),
                   fields(reasoning="The tool gave the sum.", answer=a + b)]
    else:
        replies = [fields(next_thought="I know it.", next_tool_name="finish", next_tool_args="{}"),
                   fields(reasoning="I know the answer.", answer=rng.choice([a, b]))]
    lm = Scripted(replies)
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        agent.react(question=question)
    assert not lm.replies, "ReAct made fewer calls than scripted"
    return lm.calls


class ReactTeacher:
    key = "react-dspy-" + hashlib.sha1(b"".join((HERE / f).read_bytes() for f in RECIPE)).hexdigest()[:8]
    vocab_size = 1024  # DSPy's prompts are long and mostly fixed text: larger tokens keep them short

    def samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            row = make_data.problem(rng, 0)
            if row["question"] in HELD_OUT:
                continue
            out += [(tiny.render(messages), reply) for messages, reply in episode(rng, row["question"])]
        return out[:n]


teacher = ReactTeacher()
steps, batch = 360, 16  # DSPy's prompts are ~700 tokens: ~2 s a step on a busy 2-core machine
