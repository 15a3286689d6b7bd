"""The Lightning Client: `lightning worker` runs the agent in its own folder and environment for a run whose
`run.runtime = "remote"` (the Lightning Server, rollouts/remote/collect.py), on this machine or another one.

It points the process's OpenAI clients at the server (OPENAI_BASE_URL / OPENAI_API_KEY, unless the run turned
`agent.redirect_openai` off) before it imports the agent module, then runs `concurrency` claim loops: claim a
rollout, run it with `rollouts.worker.run_rollout` (tracing installed, the claim's timeout), deliver its spans
over OTLP/HTTP (`tracing.ship`: acknowledged by the server), then report its result. Every request is retried
with backoff while the server is unreachable or restarting; a finished rollout's result is retried until its
deadline, after which the server has re-run it elsewhere anyway. The protocol: docs/remote.md.

This module imports no torch, transformers, peft, fastapi, uvicorn, store or serving code: a worker's
environment needs only the agent's own dependencies and the light ones of lightning_sdk.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from rich.console import Console

from lightning_sdk import tracing
from lightning_sdk.agent import LLM, load_agent, output_json, run_environment
from lightning_sdk.errors import RunError, SetupError
from lightning_sdk.rollouts.remote import protocol
from lightning_sdk.rollouts.remote.protocol import SERVER_FILE, TOKEN_FILE, Claim, Result, RunInfo
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.remote.ship import RolloutShipper

SERVER_ENV, TOKEN_ENV = "LIGHTNING_SERVER", "LIGHTNING_TOKEN"
# A run that starts its workers (run.runtime = "processes") hands each the read end of a pipe whose write end only
# the run holds: end of file there means the run's process is gone, however it ended (kill -9 included).
LIFELINE_ENV = "LIGHTNING_WORKER_LIFELINE"
MAX_BACKOFF_S = 10.0
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as a shell reports a process it stopped
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@dataclass(frozen=True)
class Settings:
    server: str  # the server's root URL, e.g. http://10.0.0.5:8000
    token: str
    module: str
    rollout: str | None = None
    reward: str | None = None
    concurrency: int = 8
    name: str = f"{socket.gethostname()}-{os.getpid()}"
    token_path: Path | None = None  # where the token was read (--token-file, --run-dir): read again after a 401


def settings(*, module: str | None, server: str | None, token_file: Path | None, run_dir: Path | None,
             concurrency: int, rollout: str | None = None, reward: str | None = None,
             config: Path = Path("lightning.toml")) -> Settings:
    """The worker's settings from its flags, the environment (LIGHTNING_SERVER, LIGHTNING_TOKEN), a run directory
    on this machine and ./lightning.toml ([agent]); SetupError, one line, for what is missing or wrong."""
    server = server or os.environ.get(SERVER_ENV)
    if server is None and run_dir is not None:
        try:
            server = json.loads((run_dir / SERVER_FILE).read_text())["url"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SetupError(f"--run-dir {run_dir}: no readable {SERVER_FILE} with the server's url ({e}); is a "
                             f"`lightning run` with run.runtime = 'remote' using it?") from None
    if not server:
        raise SetupError(f"no server: pass --server URL (printed by `lightning run`), set {SERVER_ENV}, or give the "
                         f"run's directory on this machine with --run-dir")
    if not server.startswith(("http://", "https://")):
        raise SetupError(f"--server {server!r}: expected an http:// or https:// URL")
    token, token_path = None, None
    if token_file is not None:
        token, token_path = _read_token(token_file, "--token-file"), token_file
    elif os.environ.get(TOKEN_ENV):
        token = os.environ[TOKEN_ENV].strip()
    elif run_dir is not None:
        token, token_path = _read_token(run_dir / TOKEN_FILE, "--run-dir"), run_dir / TOKEN_FILE
    if not token:
        raise SetupError(f"no token: pass --token-file (the run directory's {TOKEN_FILE}), set {TOKEN_ENV}, or give "
                         f"the run's directory on this machine with --run-dir")
    if module is None:
        module, rollout, reward = _from_config(config, rollout, reward)
    if module.endswith(".py") and not Path(module).is_file():
        raise SetupError(f"agent module {module!r}: file not found (run the worker in the agent's folder, or give "
                         f"the module's path)")
    return Settings(server=server.rstrip("/"), token=token, module=module, rollout=rollout, reward=reward,
                    concurrency=concurrency, token_path=token_path)


def _read_token(path: Path, flag: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise SetupError(f"{flag}: cannot read the token file {path} ({e.strerror})") from None
    if not token:
        raise SetupError(f"{flag}: the token file {path} is empty")
    return token


def _from_config(path: Path, rollout: str | None, reward: str | None) -> tuple[str, str | None, str | None]:
    """[agent] of lightning.toml: module (a .py path relative to the file), rollout, reward; flags win."""
    if not path.is_file():
        raise SetupError(f"no agent module: name it (`lightning worker agent.py`), or run in a folder whose "
                         f"{path} has [agent] module")
    try:
        agent = tomllib.loads(path.read_text()).get("agent") or {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SetupError(f"{path}: cannot read it ({e})") from None
    module = agent.get("module")
    if not isinstance(module, str) or not module:
        raise SetupError(f"{path}: no [agent] module; name the agent module on the command line")
    if module.endswith(".py") and not Path(module).is_absolute():
        module = str(path.resolve().parent / module)
    return module, rollout or agent.get("rollout"), reward or agent.get("reward")


class Unauthorized(SetupError):
    pass


class _Rows:
    """`run_rollout`'s rollout sink: the server writes the rows; what the store would get is kept for the report."""

    def __init__(self) -> None:
        self.finished: dict[str, dict[str, Any]] = {}

    def start_rollout(self, rollout_id: str, **kw: Any) -> None:
        pass

    def finish_rollout(self, rollout_id: str, **kw: Any) -> None:
        self.finished[rollout_id] = kw

    def write_spans(self, records: Any) -> None:  # tracing's sink: spans go out through the shipper instead
        pass


class Worker:
    def __init__(self, s: Settings, console: Console):
        self.s, self.console = s, console
        self.rows = _Rows()
        self.done = {"succeeded": 0, "failed": 0, "not reported": 0, "refused": 0}
        self._outage = False
        self._connected = False  # the server has taken the token once: a 401 after that is a restarted server
        self._token = s.token
        self._phase: tuple[str, int] | None = None
        self.signal: int | None = None  # the SIGINT / SIGTERM that stops the worker
        self.shipper: RolloutShipper | None = None
        self._loops: list[asyncio.Task] = []
        self._running: dict[asyncio.Task, str] = {}  # claim loop -> the rollout it runs now
        self._cut: list[str] = []  # rollouts a second signal stopped: the server re-runs them

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signal, 0)

    def run(self) -> str:
        """Work until the run is over, or a SIGINT / SIGTERM drains it (`exit_code` says which); returns the closing
        line. SetupError for bad input, RunError else."""
        end_with_run(self.console)
        # Set both handlers ourselves: a job a script starts in the background inherits SIGINT ignored.
        previous = {sig: signal.signal(sig, self._interrupt) for sig in EXIT_CODES}
        try:
            return asyncio.run(self._main())
        except KeyboardInterrupt:  # a signal before the claim loops started: nothing claimed yet
            self.signal = self.signal or signal.SIGINT
            return f"worker stopped ({SIGNAL_NAMES[self.signal]}) before it claimed a rollout"
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _interrupt(self, signum: int, frame: Any) -> None:
        self.signal = signum
        raise KeyboardInterrupt

    def _stop(self, signum: int) -> None:
        """First signal: claim no more, let the rollouts in flight finish and be reported. Second: stop at once."""
        if self.signal is None:
            self.signal = signum
            for task in self._loops:
                if task not in self._running:
                    task.cancel()  # waiting for work (a claim granted as it is cancelled: re-run at its deadline)
            self.console.print(f"stopping ({SIGNAL_NAMES[signum]}): no more claims; finishing "
                               f"{len(self._running)} rollout(s) in flight ({SIGNAL_NAMES[signum]} again to stop at "
                               f"once)", highlight=False, soft_wrap=True)
            return
        self._cut = sorted(self._running.values())
        for task in self._loops:
            task.cancel()

    def _closing(self) -> str:
        line = f"worker stopped ({SIGNAL_NAMES[self.signal]}): {self._tally()}"
        if self._cut:
            its = "its" if len(self._cut) == 1 else "their"
            return line + f"; the server re-runs {', '.join(self._cut)} after {its} deadline"
        return line + "; every rollout it claimed was reported, nothing for the server to re-run"

    async def _main(self) -> str:
        s = self.s
        headers = {"Authorization": f"Bearer {s.token}"}
        timeout = httpx.Timeout(30.0, read=protocol.LONG_POLL_S + 15)
        async with httpx.AsyncClient(base_url=s.server, headers=headers, timeout=timeout) as self.http:
            r = await self._request("GET", protocol.RUN, what="connect")
            if r.status_code != 200:
                raise SetupError(f"--server {s.server}: GET {protocol.RUN} answered {r.status_code}; is this the URL "
                                 f"a `lightning run` with run.runtime = 'remote' printed?")
            info = RunInfo.model_validate(r.json())
            if info.over:
                return f"run {info.name!r} at {s.server} is over; nothing to do"
            with run_environment(f"{s.server}/v1", info.api_key, redirect_openai=info.redirect_openai):
                self.rollout_fn, self.reward_fn = load_agent(s.module, s.rollout, s.reward)
                self._install_tracing()
                self.console.print(f"worker {s.name}: run {info.name!r} at {s.server}, agent {s.module}, "
                                   f"{s.concurrency} rollout(s) at a time", highlight=False, soft_wrap=True)
                loop = asyncio.get_running_loop()
                self._loops = [asyncio.create_task(self._loop()) for _ in range(s.concurrency)]
                for sig in EXIT_CODES:
                    loop.add_signal_handler(sig, self._stop, sig)
                pending, ended = set(self._loops), set()
                try:
                    while pending:
                        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        ended |= done
                        if self.signal is None or any(not t.cancelled() and t.exception() for t in done):
                            break  # the run is over, or a loop failed: the others stop too
                finally:
                    for sig in EXIT_CODES:
                        loop.remove_signal_handler(sig)
                    for t in self._loops:
                        t.cancel()
                    await asyncio.gather(*self._loops, return_exceptions=True)
                for t in ended:
                    if not t.cancelled():
                        t.result()  # a loop ends when the run is over or the worker stops, or raises
        if self.signal is not None:
            return self._closing()
        return f"run {info.name!r} is over: worker {s.name} exits ({self._tally()})"

    def _install_tracing(self) -> None:
        self.shipper = RolloutShipper(self._exporter())
        tracing.install(self.rows, gateway_url=f"{self.s.server}/v1", outlets=[self.shipper])

    def _exporter(self) -> Any:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=f"{self.s.server}{protocol.TRACES}", compression=Compression.Gzip,
                                headers={"Authorization": f"Bearer {self._token}"}, timeout=10)

    def _tally(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in self.done.items() if n) or "no rollouts"

    async def _loop(self) -> None:
        name = self.s.name  # the server knows workers by process: one name for all its loops
        while self.signal is None:
            r = await self._request("POST", protocol.CLAIM, json={"worker": name}, what="claim")
            if r.status_code == 204:
                continue
            if r.status_code == 410:
                return
            if r.status_code != 200:
                raise RunError(f"the server answered a claim with {r.status_code}: {r.text[:300]}")
            claim = Claim.model_validate(r.json())
            self._running[asyncio.current_task()] = claim.job().rollout_id
            try:
                await self._rollout(claim, name)
            finally:
                del self._running[asyncio.current_task()]

    async def _rollout(self, claim: Claim, name: str) -> None:
        deadline = time.monotonic() + claim.deadline_s
        job = claim.job()
        if self._phase != (job.phase, job.iteration):
            self._phase = (job.phase, job.iteration)
            self.console.print(f"{job.phase} rollouts of iteration {job.iteration} ({claim.llm.model})",
                               highlight=False)
        llm = LLM(base_url=claim.llm.base_url, api_key=claim.llm.api_key, model=claim.llm.model)
        result = await run_rollout(job, rollout_fn=self.rollout_fn, reward_fn=self.reward_fn, llm=llm,
                                   store=self.rows, timeout=claim.timeout, claim=claim.secret,
                                   span_id=claim.span_id)
        row = self.rows.finished.pop(job.rollout_id, {})
        left = deadline - time.monotonic()
        try:  # the writer hands the rollout's spans to the shipper
            await asyncio.to_thread(tracing.flush, max(1.0, left))
        except TimeoutError:
            self._drop(job.rollout_id, "its spans were not all traced before its deadline")
            return
        left = deadline - time.monotonic()
        if not await asyncio.to_thread(self.shipper.deliver, job.rollout_id, max(0.0, left)):
            self._drop(job.rollout_id, "its spans could not be delivered before its deadline")
            return
        body = Result(worker=name, status=result.status, output=json.loads(output_json(result.output)),
                      reward=result.reward, error=result.error, traceback=row.get("traceback"),
                      failed_in=result.failed_in, agent=(getattr(self.rollout_fn, "__name__", "") or "rollout")[:200])
        r = await self._request("POST", protocol.RESULT.format(rollout_id=quote(job.rollout_id, safe="")),
                                content=body.model_dump_json(), until=deadline, what="report",
                                headers={protocol.CLAIM_HEADER: claim.secret})
        if r is None:
            self._drop(job.rollout_id, "its result could not be reported before its deadline")
        elif r.status_code == 409:
            self.done["refused"] += 1
            self.console.print(f"[yellow]{job.rollout_id}: the server no longer expected this result (its "
                               f"deadline passed; it re-runs the rollout): ignored", highlight=False)
        elif r.status_code != 200:
            raise RunError(f"the server refused the result of {job.rollout_id} ({r.status_code}): {r.text[:300]}")
        else:
            self.done[result.status] += 1

    def _drop(self, rollout_id: str, why: str) -> None:
        self.done["not reported"] += 1
        self.console.print(f"[yellow]{rollout_id}: {why}; not reported (the server re-runs it)", highlight=False)

    async def _request(self, method: str, path: str, *, what: str, until: float | None = None,
                       **kw: Any) -> httpx.Response | None:
        """Send; while the server is unreachable or answers 5xx, again with backoff (until `until`, a monotonic
        time: then None). A 401 raises Unauthorized, unless the server took the token before: then it was restarted
        (`--resume`), and the worker waits for it, reading its token again."""
        if "content" in kw:
            kw.setdefault("headers", {})["Content-Type"] = "application/json"
        delay = 0.25
        while True:
            try:
                r = await self.http.request(method, path, **kw)
                problem = None if r.status_code < 500 else f"HTTP {r.status_code}"
            except httpx.TransportError as e:
                r, problem = None, type(e).__name__
            if problem is None and r.status_code == 401:
                if not self._connected:
                    raise Unauthorized(f"the server at {self.s.server} refused the token (401): use the run's "
                                       f"{TOKEN_FILE} (--token-file) or {TOKEN_ENV}")
                # It took the token before: the run was restarted (`--resume`) with another. Wait for it, reading
                # the token again where it came from.
                problem = "it refused the token (401); reading the token again"
                self._reread_token()
            elif problem is None:
                self._connected = True
                if self._outage:
                    self._outage = False
                    self.console.print(f"server {self.s.server} reachable again", highlight=False)
                return r
            if until is not None and time.monotonic() + delay > until:
                return None
            if not self._outage:
                self._outage = True
                self.console.print(f"[yellow]{what}: server {self.s.server} unreachable ({problem}); retrying with "
                                   f"backoff", highlight=False)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, MAX_BACKOFF_S)

    def _reread_token(self) -> None:
        path = self.s.token_path
        try:
            token = path.read_text().strip() if path is not None else ""
        except OSError:
            return
        if token and token != self._token:
            self._token = token
            self.http.headers["Authorization"] = f"Bearer {token}"
            if self.shipper is not None:
                self.shipper.exporter = self._exporter()


def end_with_run(console: Console) -> None:
    """With LIFELINE_ENV set (a worker its run started): exit as soon as the run's process is gone. Nothing this
    worker holds can be reported to a run that is gone; a resumed run starts workers of its own."""
    fd = os.environ.pop(LIFELINE_ENV, None)  # not handed on to what the agent starts
    if fd is None or not fd.isdigit():
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 64):
                pass
        except OSError:
            pass
        console.print(f"worker {os.getpid()}: the run that started it is gone; exiting", highlight=False,
                      soft_wrap=True)
        sys.stdout.flush()  # os._exit skips it; the line goes to the run's workers.log
        os._exit(1)

    threading.Thread(target=watch, name="lightning-worker-lifeline", daemon=True).start()
