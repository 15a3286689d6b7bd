"""lightning-agent-rl (import package `lightning_sdk`): train the LLM inside an existing agent with reinforcement
learning.

The agent-side surface is all here and imports no torch: mark the episode with `@rollout`, its score with
`@reward`, tag roles with `component(...)`, add intermediate rewards with `emit_reward(...)`; a deployed app
sends late rewards to `lightning serve` with `feedback(...)`.
Training is started by `lightning run`, or from Python (a script or a notebook) by `run(...)` (lightning_sdk.api,
imported on first use so that importing the agent side stays light).
"""

import sys as _sys

from lightning_sdk.agent import LLM, reward, rollout
from lightning_sdk.distribution import VERSION as __version__  # noqa: F401 - the package version
from lightning_sdk.distribution import conflict_line as _conflict_line
from lightning_sdk.tracing import component, emit_reward
from lightning_sdk.tracing.feedback import FeedbackRefused, feedback

__all__ = ["LLM", "FeedbackRefused", "RunResult", "component", "emit_reward", "feedback", "reward", "rollout", "run"]

if (_line := _conflict_line()) is not None:
    print(_line, file=_sys.stderr)


def __getattr__(name: str):
    # run / RunResult pull in the runtime (torch, transformers): only when asked for.
    if name in ("run", "RunResult"):
        from lightning_sdk import api

        return getattr(api, name)
    raise AttributeError(f"module 'lightning_sdk' has no attribute {name!r}")
