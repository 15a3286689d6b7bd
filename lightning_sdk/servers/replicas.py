"""Several inference servers as one (serve.replicas): each on its own GPU set (or share of the CPU cores), all with
one key, behind the gateway's least-loaded routing (gateway/routing.py). Every adapter is loaded into every
replica before the load returns, so the runtime routes no call to a version that some replica lacks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_sdk.constraint import ServerGrammar
from lightning_sdk.servers.process import ServerProcess


class ReplicaSet:
    """`ServerProcess`es that start, stop, sleep, wake and load adapters together; an `InferenceServer`."""

    name = "inference servers"

    def __init__(self, replicas: Sequence[ServerProcess]):
        if len({r.api_key for r in replicas}) != 1:
            raise ValueError("the replicas of a set share one api key")
        self.replicas = list(replicas)
        self.served_model_name = replicas[0].served_model_name
        self.api_key = replicas[0].api_key

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def grammar(self) -> ServerGrammar:
        """What the replicas apply to a constraint (all started from one config)."""
        return self.replicas[0].grammar

    @property
    def base_url(self) -> str:
        """The first replica's: control calls go to each (this set's methods), requests through the gateway."""
        return self.replicas[0].base_url

    @property
    def can_sleep(self) -> bool:
        return all(getattr(r, "can_sleep", False) for r in self.replicas)

    def _each(self, fn: Callable[[Any], Any], replicas: Sequence[ServerProcess] | None = None) -> None:
        """`fn` on every replica at once; the first failure raises once all have ended."""
        replicas = self.replicas if replicas is None else replicas
        if not replicas:
            return
        with ThreadPoolExecutor(len(replicas), thread_name_prefix="lightning-replica") as pool:
            done = [pool.submit(fn, r) for r in replicas]
        for f in done:
            f.result()

    def start(self) -> None:
        try:
            self._each(lambda r: r.start())
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._each(lambda r: r.stop())

    def is_alive(self) -> bool:
        return all(r.is_alive() for r in self.replicas)

    def answers(self) -> bool:
        return all(r.answers() for r in self.replicas)

    def restart(self, adapters: dict[str, Path]) -> None:
        """The replicas that died, started again on their ports with `adapters`; the others serve meanwhile."""
        self._each(lambda r: r.restart(adapters), [r for r in self.replicas if not r.answers()])

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        self._each(lambda r: r.load_adapter(name, path, replace=replace))

    def unload_adapter(self, name: str) -> None:
        self._each(lambda r: r.unload_adapter(name))

    def sleep(self) -> None:
        self._each(lambda r: r.sleep())

    def wake_up(self) -> None:
        self._each(lambda r: r.wake_up())

    def log_tail(self, n: int = 50) -> str:
        return "\n".join(f"[{r.url}]\n{r.log_tail(n)}" for r in self.replicas)
