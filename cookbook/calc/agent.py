"""Math word problems with a calculator tool: an ordinary AutoGen (autogen-agentchat) assistant.

The agent is written the way AutoGen's own examples write one: an `OpenAIChatCompletionClient` (pointed at the
runtime's server, with `model_info` because the model is not an OpenAI one) and an `AssistantAgent` with a Python
function as its tool. The decorators are the only lightning-sdk code. A calculator call with a bad expression
raises; AutoGen records the tool span as failed and hands the error back to the model, and lightning-sdk credits
`rollout.error_reward` to the LLM call that wrote the bad expression.
"""

import ast
import operator
import re

from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

import lightning_sdk as ls

SYSTEM_MESSAGE = "Solve the problem. Use the calculator, then give the number."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. 12*3-5."""
    try:
        result = _value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e}") from None
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


@ls.rollout
async def solve(task: dict, llm: ls.LLM) -> str:
    model_client = OpenAIChatCompletionClient(
        model=llm.model,
        base_url=llm.base_url,
        api_key=llm.api_key,
        model_info=ModelInfo(vision=False, function_calling=True, json_output=False,
                             family=ModelFamily.UNKNOWN, structured_output=False),
        temperature=1.0,
        max_tokens=48,
    )
    agent = AssistantAgent(
        "calc",
        model_client=model_client,
        tools=[calculator],
        system_message=SYSTEM_MESSAGE,
        reflect_on_tool_use=True,  # after the tool result, one more LLM call writes the answer
    )
    try:
        result = await agent.run(task=task["question"])
    finally:
        await model_client.close()
    return result.messages[-1].to_text()


def _last_number(text: str) -> float | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(found[-1]) if found else None


@ls.reward
def score(task: dict, output: str) -> float:
    got = _last_number(output)
    return float(got is not None and abs(got - float(task["result"])) < 1e-6)
