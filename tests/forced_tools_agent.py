"""A calculator agent whose every call is a forced tool call ("required", then the named function), under two
components: `strict` offers the tool with `"strict": true`, `loose` the same tool without the field. For the
vLLM-lane test of tests/test_vllm_constrained.py: each component is a policy, so the run reports each one's
trainer-vs-vLLM log-prob gap."""

from openai import AsyncOpenAI

import lightning_sdk as ls

client = AsyncOpenAI(max_retries=0)
CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}
SYSTEM = "Solve the problem. Use the calculator, then give the number."


async def expression(role: str, question: str, tool_choice: object) -> str:
    tool = {"type": "function", "function": {**CALCULATOR, **({"strict": True} if role == "strict" else {})}}
    with ls.component(role):
        out = await client.chat.completions.create(
            model="gpt-4o-mini", temperature=1.0, max_tokens=48, tools=[tool], tool_choice=tool_choice,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    calls = out.choices[0].message.tool_calls or []
    return calls[0].function.arguments if calls else ""


@ls.rollout
async def solve(task: dict) -> list:
    named = {"type": "function", "function": {"name": "calculator"}}
    return [await expression(role, task["question"], choice) for role in ("strict", "loose")
            for choice in ("required", named)]


@ls.reward
def score(task: dict, arguments: list) -> float:
    # plus a little for length, so a group's rewards differ and every group carries an advantage
    return sum(task["chain"] in a for a in arguments) / len(arguments) + sum(len(a) for a in arguments) / 1000
