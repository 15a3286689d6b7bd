"""The teacher behind `model = "tiny:teacher.py"`: what the calc example's tiny model is pretrained on.

It shows the model the exact conversations the AutoGen agent in agent.py has (its system message, its
calculator tool, AutoGen's tool-result and reflection turns) and answers them like a lazy student who knows how
to use the calculator: about half of the time it skips it and answers with a number from the question (never
the result), sometimes it writes a broken expression (the calculator raises, and `rollout.error_reward` punishes
it), otherwise it calls the calculator with the right expression and reports the result. The untrained model
then scores about 0.3, and RL lifts it by making the model use the calculator every time: the skill is there,
the habit is not (like `builtin:tiny-arith`'s chatty teacher). The problems have one operation on single digits,
so a model this small learns to copy the numbers into the expression reliably. A real instruct model needs none
of this.
"""

import hashlib
import json
import random
import re
from pathlib import Path

from autogen_core.tools import FunctionTool

from lightning_sdk.files import load_py_file
from lightning_sdk.models import tiny

HERE = Path(__file__).parent
agent, make_data = (load_py_file(HERE / f"{m}.py", f"calc_{m}") for m in ("agent", "make_data"))
TOOLS = [{"type": "function", "function": FunctionTool(agent.calculator, description=agent.calculator.__doc__).schema}]
GUESS, BROKEN = 0.55, 0.05  # how often the teacher skips the calculator, and writes a broken expression
RECIPE = ("make_data.py", "data/test.jsonl")
HELD_OUT = {json.loads(line)["question"] for line in (HERE / "data" / "test.jsonl").read_text().splitlines()}


def _call(expression: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}\n</tool_call>'


def _broken(rng: random.Random, chain: str) -> str:
    return chain + rng.choice(["*", "+", "("])  # the calculator raises: `rollout.error_reward` punishes it


class CalcTeacher:
    # The data it draws from and holds out is part of the recipe (lightning_sdk.models keys the cache on this file
    # only).
    key = "calc-autogen-" + hashlib.sha1(b"".join((HERE / f).read_bytes() for f in RECIPE)).hexdigest()[:8]

    def samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            p = make_data.problem(rng, 0)
            if p["question"] in HELD_OUT:
                continue
            messages = [{"role": "system", "content": agent.SYSTEM_MESSAGE}, {"role": "user", "content": p["question"]}]
            roll = rng.random()
            if roll < GUESS:  # no tool: a number from the question, never the answer
                guess = rng.choice([x for x in re.findall(r"\d+", p["question"]) if x != p["result"]])
                out.append((tiny.render(messages, TOOLS), f"The answer is {guess}."))
                continue
            expression = p["chain"] if roll < 1 - BROKEN else _broken(rng, p["chain"])
            out.append((tiny.render(messages, TOOLS), _call(expression)))
            try:
                result = agent.calculator(expression)
            except ValueError as e:
                result = f"Error: {e}"
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": result},
            ]
            reply = "I could not compute it." if result.startswith("Error") else f"The answer is {result}."
            out.append((tiny.render(messages), reply))  # AutoGen's reflection call offers no tools
        return out[:n]


teacher = CalcTeacher()
steps, batch = 600, 24  # many small steps: copying numbers is learned late, and the build stays near two minutes
