"""A running inference server lent to another session: `lightning serve`'s gate scores its candidate on the server
that serves the app (the candidate a LoRA adapter loaded beside the serving one) instead of starting a second copy
of the model, which one GPU cannot hold beside the first.

The borrower neither starts, stops nor restarts it (its owner does); what it loads it unloads when it is done
(`stop`), so the owner's server is left serving what it served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_sdk.constraint import ServerGrammar
from lightning_sdk.errors import ServerError


class LentServer:
    """`server` as an `InferenceServer` whose start and stop are the borrower's: nothing to start, and the adapters
    loaded through it unloaded on stop."""

    name = "serving backend (lent)"

    def __init__(self, server: Any):
        self.server = server
        self.loaded: list[str] = []  # adapters this borrower loaded, in order

    @property
    def urls(self) -> list[str]:
        return list(self.server.urls)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def api_key(self) -> str | None:
        return self.server.api_key

    @property
    def grammar(self) -> ServerGrammar:
        return self.server.grammar

    @property
    def served_model_name(self) -> str:
        return self.server.served_model_name

    def start(self) -> None:
        if not self.server.answers():
            raise ServerError("the serving backend does not answer; its owner restarts it")

    def stop(self) -> None:
        """Every adapter this borrower loaded is unloaded (all are tried; the first failure raises after)."""
        failed: ServerError | None = None
        while self.loaded:
            try:
                self.server.unload_adapter(self.loaded.pop())
            except ServerError as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def is_alive(self) -> bool:
        return self.server.is_alive()

    def answers(self) -> bool:
        return self.server.answers()

    def restart(self, adapters: dict[str, Path]) -> None:
        raise ServerError("the serving backend died; its owner (lightning serve) restarts it, not a borrower")

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        # replace: a gate cut short (kill -9) may have left an adapter of this name; the same name is the same version
        self.server.load_adapter(name, path, replace=True)
        if name not in self.loaded:
            self.loaded.append(name)

    def unload_adapter(self, name: str) -> None:
        self.server.unload_adapter(name)
        if name in self.loaded:
            self.loaded.remove(name)

    def log_tail(self, n: int = 50) -> str:
        return self.server.log_tail(n)
