"""The private names of other libraries this project touches, each where no public route exists, named here once.

tests/test_compat.py fails loudly when one of them is gone from the installed version, instead of a run quietly
losing what it did.
"""

from __future__ import annotations

import sys
from typing import Any


def span_processors(provider: Any) -> Any:
    """The processors of an application's OpenTelemetry SDK TracerProvider (None if it has none we can reach).

    The SDK offers `add_span_processor` but no way to hand an already finished span to a provider's processors,
    which is what giving the application a span recorded elsewhere (a remote worker's, the gateway's) needs.
    `_active_span_processor` has held them since opentelemetry-sdk 1.0.
    """
    return getattr(provider, "_active_span_processor", None)


def drop_agents_sdk_client() -> None:
    """Forget the OpenAI Agents SDK's process-wide httpx client, if the SDK is imported.

    Its default model shares one client across the process, bound to the event loop that first used it: after
    the agent ran on another loop (a notebook's earlier `Runner.run_sync`, a test) every call of a run would fail
    with "Event loop is closed". The SDK has no public way to reset it; dropped, its next call makes one.
    """
    provider = sys.modules.get("agents.models.openai_provider")
    if provider is not None and hasattr(provider, "_http_client"):
        provider._http_client = None


def connection(fd: int) -> Any:
    """A `multiprocessing.connection.Connection` over the socket `fd` (its sending and receiving of pickles).

    The standard library documents the connections `Pipe()`, `Listener` and `Client` make, not the constructor
    that wraps a descriptor, which is what a child started with `subprocess` (not `multiprocessing`, whose spawn
    re-imports the caller's `__main__`) needs for the socket pair it inherits (gateway/isolated.py).
    `Connection(handle)` has taken a file descriptor since Python 3.3.
    """
    from multiprocessing.connection import Connection

    return Connection(fd)


def attn_implementation(model: Any) -> str:
    """The attention implementation a transformers model runs ("sdpa", "eager", ...).

    transformers sets it with the public `set_attn_implementation` but reads it back only through the config's
    `_attn_implementation`; the trainer needs it to put a model's own attention back (train/head.py).
    """
    return model.config._attn_implementation
