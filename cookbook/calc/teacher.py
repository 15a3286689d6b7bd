"""The teacher behind `model = "tiny:teacher.py"`: what the calc example's tiny model is pretrained on.

It shows the model the exact conversations the AutoGen agent in agent.py has (its system message, its
calculator tool, AutoGen's tool-result and reflection turns) and answers them like a mediocre student: it calls
the calculator with the right expression about half the time, with a wrong or broken one (which fails, and is
punished by `rollout.error_reward`) or guesses the number otherwise. The untrained model then scores above zero,
and RL has room to make it use the calculator correctly. A real instruct model needs none of this.
"""

import importlib.util
import json
import random
from pathlib import Path

from autogen_core.tools import FunctionTool

from lightning_sdk import tiny

HERE = Path(__file__).parent


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"calc_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


agent, make_data = _sibling("agent"), _sibling("make_data")
TOOLS = [{"type": "function", "function": FunctionTool(agent.calculator, description=agent.calculator.__doc__).schema}]
HELD_OUT = {json.loads(line)["question"] for line in (HERE / "data" / "test.jsonl").read_text().splitlines()}


def _call(expression: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}\n</tool_call>'


def _wrong(rng: random.Random, chain: str) -> str:
    if rng.random() < 0.5:
        return chain + rng.choice(["*", "+", "("])  # broken: the calculator raises
    ops = [c for c in "+-*/" if c in chain]
    return chain.replace(ops[0], rng.choice([o for o in "+-*" if o != ops[0]]), 1)  # valid, wrong


class CalcTeacher:
    key = "calc-autogen"

    def samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            p = make_data.problem(rng, 0)
            if p["question"] in HELD_OUT:
                continue
            messages = [{"role": "system", "content": agent.SYSTEM_MESSAGE}, {"role": "user", "content": p["question"]}]
            roll = rng.random()
            expression = p["chain"] if roll < 0.5 else _wrong(rng, p["chain"])
            if roll > 0.85:  # no tool: a guess
                guess = int(float(p["result"])) + rng.choice([-2, -1, 1, 2, 0])
                out.append((tiny.render(messages, TOOLS), f"The answer is {guess}."))
                continue
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
            if result.startswith("Error"):
                reply = rng.choice(["I could not compute it.", f"It is {rng.randint(1, 40)}."])
            else:
                reply = rng.choice(["{}", "The answer is {}.", "{}."]).format(result)
            out.append((tiny.render(messages), reply))  # AutoGen's reflection call offers no tools
        return out[:n]


teacher = CalcTeacher()
steps, batch = 400, 32  # ~120-token conversations: a smaller batch keeps the build to a minute or two
