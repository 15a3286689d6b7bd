"""The teacher behind the react_dspy example's `model = "tiny:teacher.py"`.

It runs the agent's own `dspy.ReAct` (agent.py) with DSPy's default ChatAdapter, over a scripted LM that answers
each of ReAct's calls in that adapter's field format (`[[ ## next_thought ## ]]`, `[[ ## next_tool_name ## ]]`,
`[[ ## next_tool_args ## ]]`, then the extract step's `[[ ## reasoning ## ]]` and `[[ ## answer ## ]]`): the
model learns the exact prompts DSPy sends and the replies its parser reads. It answers like a lazy student who
knows the `add` tool: about half of the time it calls `add` with the question's numbers, then finishes and
reports the tool's result; otherwise it finishes at once and answers with a number from the question (never the
sum). The untrained model then scores about half, and RL lifts it by making the tool call a habit (like the calc
example's teacher). A real instruct model needs none of this.

Each right answer is copied out of a ~700-token prompt: the question's numbers into `add`'s arguments, the tool's
result into the next thought ("The sum is 12.", where the result is the prompt's last field), and that thought
into the extract step's reasoning and answer (the same words before the number, which copying heads match). A
model this small learns such copies only with help, as the rag example's does: the first `WARMUP` steps train on
copy drills alone (a line of the episodes' words and numbers, then the same line: short samples, so they are
cheap), and a share of every later batch too.
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
WARMUP, DRILLS = 300, 0.2  # copy drills: the steps of them alone, then their share of every later batch
WORDS = ["What is", "plus", "Add", "and", "How much is", "+", "?", ".", "The sum is", '{"a":', '"b":', "}", "add",
         "[[ ## observation_0 ## ]]\n", "[[ ## answer ## ]]\n"]  # what drills are made of, besides numbers
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
                   fields(next_thought=f"The sum is {a + b}.", next_tool_name="finish", next_tool_args="{}"),
                   fields(reasoning=f"The sum is {a + b}.", answer=a + b)]
    else:
        replies = [fields(next_thought="I know it.", next_tool_name="finish", next_tool_args="{}"),
                   fields(reasoning="I know the answer.", answer=rng.choice([a, b]))]
    lm = Scripted(replies)
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        agent.react(question=question)
    assert not lm.replies, "ReAct made fewer calls than scripted"
    return lm.calls


def _drill(rng: random.Random) -> tuple[str, str]:
    """A line of the episodes' words and numbers, then the same line: copying, learnt on short samples."""
    line = " ".join(rng.choice(WORDS) if rng.random() < 0.5 else str(rng.randint(1, 18))
                    for _ in range(rng.randint(2, 10)))
    return line + "\n", line


class ReactTeacher:
    key = "react-dspy-" + hashlib.sha1(b"".join((HERE / f).read_bytes() for f in RECIPE)).hexdigest()[:8]
    vocab_size = 1024  # DSPy's prompts are long and mostly fixed text: larger tokens keep them short
    warmup_steps = WARMUP

    def warmup_samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        return [_drill(rng) for _ in range(n)]

    def samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            if rng.random() < DRILLS:
                out.append(_drill(rng))
                continue
            row = make_data.problem(rng, 0)
            if row["question"] in HELD_OUT:
                continue
            out += [(tiny.render(messages), reply) for messages, reply in episode(rng, row["question"])]
        return out[:n]


teacher = ReactTeacher()
steps, batch = 1000, 16  # the drills take seconds; DSPy's ~700-token prompts ~2 s a step on a busy 2-core machine
