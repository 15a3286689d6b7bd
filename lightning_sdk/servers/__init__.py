"""Inference servers as the runtime sees them: an OpenAI-compatible base URL plus LoRA hot-swapping.

Only the protocols and the error live here, so that code which merely talks to a server imports nothing else.
`cpu.CPUServer` runs the built-in transformers server (`python -m lightning_sdk.engine`) in a subprocess;
`vllm.VLLMServer` runs vLLM's OpenAI server the same way (GPU). Both are `process.ServerProcess`es.
torch, transformers and vllm are imported only in the server process.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lightning_sdk.constraint import ServerGrammar
from lightning_sdk.errors import ServerError

__all__ = ["InferenceServer", "ServerError", "SleepableServer"]


@runtime_checkable
class InferenceServer(Protocol):
    base_url: str  # ".../v1", for openai.OpenAI(base_url=...)
    api_key: str | None
    served_model_name: str
    grammar: ServerGrammar  # what it applies to a constraint: the gateway records it with each call's

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def is_alive(self) -> bool: ...
    def load_adapter(self, name: str, path: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    def log_tail(self, n: int = 50) -> str: ...


@runtime_checkable
class SleepableServer(Protocol):
    """A server that can hand its accelerator memory to the trainer between collection phases (vLLM sleep mode)."""

    can_sleep: bool  # False when the server was started without sleep support

    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
