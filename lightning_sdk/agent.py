"""The agent-side API: `@rollout`, `@reward` and the `LLM` handle. Plain functions stay plain.

The decorators only mark a function so `lightning run` can find it; calling it yourself just runs your agent.
This module (like `tracing`) imports no torch and no server code, so the agent's environment stays light.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ROLLOUT_MARK = "__lightning_rollout__"
REWARD_MARK = "__lightning_reward__"


@dataclass(frozen=True)
class LLM:
    """Where the agent sends its LLM calls during training: the runtime's OpenAI-compatible server.

    `model` names the policy being trained (the newest adapter), so it changes between iterations.
    `sampling` holds the run's suggested sampling settings, for agents that want them.
    """

    base_url: str
    api_key: str
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)


def _check_arity(fn: Callable, needed: int, what: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    required = [p for p in params if p.default is p.empty]
    if not varargs and (len(params) < needed or len(required) > needed):
        raise TypeError(f"@{what} {fn.__qualname__}{sig}: expected a function of {needed} positional arguments")


def rollout(fn: F) -> F:
    """Mark `fn(task, llm)` (sync or async) as one episode of the agent; its return value goes to `@reward`."""
    _check_arity(fn, 2, "rollout")
    setattr(fn, ROLLOUT_MARK, True)
    return fn


def reward(fn: F) -> F:
    """Mark `fn(task, output) -> float` (sync or async) as the episode's score."""
    _check_arity(fn, 2, "reward")
    setattr(fn, REWARD_MARK, True)
    return fn


def is_rollout(obj: Any) -> bool:
    return callable(obj) and getattr(obj, ROLLOUT_MARK, False) is True


def is_reward(obj: Any) -> bool:
    return callable(obj) and getattr(obj, REWARD_MARK, False) is True
