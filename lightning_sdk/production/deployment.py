"""`lightning serve`: the policy served to a deployed app by the code a run serves it with (servers.select's
backend, gateway.proxy's Gateway and its capture into the store), plus the feedback route.

Everything lives in one directory: `serve.sqlite` (every call's record and every reward: the same store a run
writes, so kill -9 loses nothing written, and a restart carries on in the same file), `serve.key` (the app's key,
made once and kept, 0600, unless one is given) and `server.log` (the backend's log).
"""

from __future__ import annotations

import os
import secrets
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from lightning_sdk import models
from lightning_sdk.config import Config
from lightning_sdk.placement import Placement, defaults_for, place
from lightning_sdk.gateway.proxy import Gateway
from lightning_sdk.production.episodes import TraceEpisodes
from lightning_sdk.production.gpu_turn import gpu_turn, sleeps, takes_turn
from lightning_sdk.production.intake import feedback_router
from lightning_sdk.production.learner import Learner
from lightning_sdk.production.ledger import FeedbackLedger
from lightning_sdk.production.promotion import Promoter, Scorer, eval_scorer
from lightning_sdk.production.retention import PRUNE_EVERY_S, Pruner
from lightning_sdk.production.schedule import Schedule
from lightning_sdk.servers import InferenceServer
from lightning_sdk.servers.select import make_server, resolved_backend, visible_gpus
from lightning_sdk.store import Store

STORE_FILE = "serve.sqlite"
KEY_FILE = "serve.key"


def kept_key(directory: Path) -> str | None:
    """The app's key kept in the directory by an earlier start, if any."""
    path = directory / KEY_FILE
    key = path.read_text().strip() if path.exists() else ""
    return key or None


def keep_key(directory: Path, key: str) -> None:
    """Keep the key for the next start, readable by this user only."""
    fd = os.open(directory / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")


@dataclass
class Deployment:
    """A started `lightning serve`: `url` (the app's base URL is `url + "/v1"`), `api_key`; `close()` stops it."""

    gateway: Gateway
    store: Store
    ledger: FeedbackLedger
    stack: ExitStack
    server: InferenceServer
    schedule: Schedule | None  # [learn]: the background trainer and its gate; None: serving only
    pruner: Pruner  # deletes calls past the retention window and the size cap
    placement: Placement  # where the servers and the learner's trainer run (placement.place, as `lightning run`)
    turns: bool  # each update takes the GPU from the servers (gpu_turn.takes_turn)

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def api_key(self) -> str:
        return self.gateway.api_key

    def close(self) -> None:
        self.stack.close()

    def placement_line(self) -> str | None:
        """Where the servers and the learner's trainer run, and which GPUs nothing uses, for serve's first lines;
        None without GPUs."""
        p = self.placement
        if not p.visible:
            return None
        n = len(p.replicas)
        said = [f"placement: {p.visible} GPU(s) visible",
                f"{n} inference server{'s' if n > 1 else ''} on "
                + "; ".join(f"GPU{'s' if len(r) > 1 else ''} {','.join(map(str, r))}" if r else "the CPU"
                            for r in p.replicas)]
        used = set(p.serving)
        if self.schedule is None:
            why = "serving only (no [learn])"
        elif p.train:
            used.add(p.train[0])
            said.append(f"the learner's trainer on GPU {p.train[0]}, "
                        + ("in turns (vLLM sleeps during each update)" if self.turns else
                           "at once (serving goes on during each update)"))
            why = "the learner trains in one process"
        else:
            said.append("the learner's trainer on the CPU/train.device, at once (serving goes on during each update)")
            why = f"the learner's trainer is not on a GPU (train.device = {self.schedule.learner.cfg.train.device!r})"
        idle = [str(g) for g in range(p.visible) if g not in used]
        if idle:
            said.append(f"GPU{'s' if len(idle) > 1 else ''} {','.join(idle)} idle: {why}")
        return "; ".join(said)


def start(cfg: Config, directory: Path, *, host: str, port: int, api_key: str | None,
          retention_s: float, scorer: Scorer | None = None, max_calls: int | None = None,
          prune_every_s: float = PRUNE_EVERY_S) -> Deployment:
    """Bind, start the backend, then serve; OSError if host:port cannot be listened on (nothing started or
    written). The app's key: `api_key`, else serve.api_key, else the one kept in the directory (made once).
    With [learn], the adapter promoted last is served again and the background trainer starts; `scorer`: how the
    gate scores an adapter (default: data.eval's tasks through the agent, production.promotion.eval_scorer).
    Calls past `retention_s` or beyond the newest `max_calls` are deleted every `prune_every_s`
    (production.retention)."""
    # Placed as `lightning run` places (a SetupError naming the key before anything is bound or written), with the
    # defaults it implies (on 2+ GPUs: vLLM awake, serve.sleep_level = 0, with 0.9 of its GPUs). The GPUs are
    # counted (torch) where a trainer may take them.
    backend = resolved_backend(cfg)
    placement = place(cfg, visible=visible_gpus(cfg, counted=cfg.learn is not None), backend=backend)
    defaults_for(cfg, placement)
    turns = takes_turn(cfg, placement, backend)
    given = api_key or cfg.serve.api_key
    key = given or (kept_key(directory) if directory.is_dir() else None)
    stack = ExitStack()
    try:
        gateway = Gateway(host=host, port=port, api_key=key or secrets.token_urlsafe(32),
                          model_names=cfg.serve.model_names, rollouts=TraceEpisodes(),
                          store_text=cfg.serve.store_text)
        stack.callback(gateway.stop)
        directory.mkdir(parents=True, exist_ok=True)  # only once the address is ours: a refusal writes nothing
        if key is None:
            keep_key(directory, gateway.api_key)
        store = stack.enter_context(Store(directory / STORE_FILE))
        ledger = FeedbackLedger(store.path, retention_s=retention_s)
        stack.callback(ledger.close)
        pruner = Pruner(store.path, retention_s=retention_s, max_calls=max_calls, every_s=prune_every_s,
                        reward_name=cfg.learn.reward_name if cfg.learn is not None else None)
        pruner.start()
        stack.callback(pruner.stop)
        server = make_server(cfg, models.resolve(cfg.model.name), directory / "server.log", placement)
        stack.callback(server.stop)
        server.start()
        gateway.capture.record_to(store)
        stack.callback(gateway.capture.record_to, None)  # flushes: every answered call is written before close
        gateway.add_routes(feedback_router(ledger, gateway.capture.flush))
        gateway.start(server.urls, backend_key=server.api_key,
                      grammar=server.grammar)
        gateway.policy = cfg.model.name
        schedule = None
        if cfg.learn is not None:
            turns = turns and sleeps(server)
            learner = Learner(cfg, directory, store, ledger, base=cfg.model.name,
                              turn=gpu_turn(gateway, server) if turns else None, gpus=placement.train)
            stack.callback(learner.close)
            promoter = Promoter(store.path, server, gateway, scorer or eval_scorer(cfg, server),
                                margin=cfg.learn.gate_margin, z=cfg.learn.gate_z, canary_share=cfg.learn.canary_share,
                                canary_min_rewards=cfg.learn.canary_min_rewards,
                                reward_name=cfg.learn.reward_name)
            schedule = Schedule(learner, promoter, cfg.learn.poll_seconds)
            schedule.start()
            stack.callback(schedule.stop)
    except BaseException:
        stack.close()
        raise
    return Deployment(gateway, store, ledger, stack, server, schedule, pruner, placement, turns)
