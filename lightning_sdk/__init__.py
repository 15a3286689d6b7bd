"""lightning-sdk: train the LLM inside an existing agent with reinforcement learning.

The agent-side surface is all here and imports no torch: mark the episode with `@rollout`, its score with
`@reward`, tag roles with `component(...)`, add intermediate rewards with `emit_reward(...)`.
Training is started by `lightning run` (see `lightning_sdk.runtime`).
"""

from lightning_sdk.agent import LLM, reward, rollout
from lightning_sdk.tracing import component, emit_reward

__all__ = ["LLM", "component", "emit_reward", "reward", "rollout"]
__version__ = "0.1.0"
