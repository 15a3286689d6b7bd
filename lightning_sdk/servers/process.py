"""An OpenAI-compatible inference server run as a managed subprocess on a local port.

What every backend shares: start the command with its log in a file, wait for `/health` for as long as the
process lives and its log grows (failing fast, with the exit code and the log's tail, when the process dies while
starting; naming serve.startup_timeout when the log stays silent that long), hot-load LoRA adapters through the
`/v1/load_lora_adapter` routes vLLM defined, and stop cleanly (terminate, then kill). A backend says only how
its process is started: `command()` and `environment()`. `control_request` is the one way to call a server's
(or the router's) control routes with its API key.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path

import httpx

from lightning_sdk.console import printable
from lightning_sdk.servers import ServerError

log = logging.getLogger("lightning_sdk")  # the runtime's logger: a slow start's progress is part of a run


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_api_key() -> str:
    """A fresh key for one run's servers, when serve.api_key gives none: without one, any local user who reads the
    port from the process table could swap the policy being trained (load_lora_adapter with load_inplace)."""
    return secrets.token_urlsafe(32)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header a server started with an API key checks; none for a server without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def control_request(method: str, url: str, *, api_key: str | None, who: str, timeout: float = 300,
                    **kw) -> httpx.Response:
    """An authenticated call to a control route (adapter load/unload, sleep, wake); `url` is the full URL (root +
    route), `who` names the server in errors. A transport error or a non-200 answer raises ServerError, with the
    OpenAI-style error.message when the server sent one."""
    route = httpx.URL(url).path
    try:
        r = httpx.request(method, url, headers=auth_headers(api_key), timeout=timeout, **kw)
    except httpx.HTTPError as e:
        raise ServerError(f"{route}: {who} unreachable ({e})") from e
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        raise ServerError(f"{route} failed ({r.status_code}): {message}")
    return r


class ServerProcess:
    """Base of the subprocess servers. `with Server(...) as server:` starts and stops it."""

    name = "inference server"  # for error messages
    stop_timeout = 10.0  # seconds between terminate and kill
    startup_ceiling_factor = 12.0  # a start may take this many startup_timeouts in all, its log growing throughout
    progress_every = 30.0  # seconds between the "still starting" lines

    def __init__(self, *, served_model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, startup_timeout: float = 300, log_path: str | Path | None = None):
        if api_key == "":
            raise ValueError("api_key must not be empty: give a key, or None for a server without one")
        self.served_model_name = served_model_name
        self.host = host
        self.port = port
        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.gpu_env: dict[str, str] = {}  # its GPUs' CUDA_VISIBLE_DEVICES (placement.gpu_environment); {}: inherited
        self._proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------------------- what a backend defines

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Variables added to this process's environment for the child (an API key goes here, never in argv)."""
        return {}

    # ------------------------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def urls(self) -> list[str]:
        """The roots the gateway sends requests to: this server's."""
        return [self.url]

    def start(self) -> None:
        if self.is_alive():
            return
        if self.port == 0:
            self.port = free_port(self.host)  # a tiny race with other processes, acceptable for a local server
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="lightning-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.gpu_env, **self.environment())
        with open(self.log_path, "ab") as log:
            # Own process group: stop() can then reach the workers a server forks (vLLM's engine core).
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:  # includes Ctrl-C while waiting: never leave the child behind
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        """Wait for `/health` while the server makes progress: its process lives and its log grows (loading
        weights, compiling, capturing graphs). Stops when the process exits, when the log has not grown for
        startup_timeout seconds, or at startup_ceiling in all; says the log's last line every progress_every s."""
        start = last_growth = last_said = time.monotonic()
        size = self._log_size()
        while True:
            if not self.is_alive():
                code = self._proc.returncode if self._proc else None
                raise ServerError(f"{self.name} exited with code {code} while starting; "
                                  f"log {self.log_path}:\n{self.log_tail(40)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if (n := self._log_size()) != size:
                size, last_growth = n, now
            if now - last_growth > self.startup_timeout:
                raise ServerError(
                    f"{self.name} wrote nothing to its log for {now - last_growth:.0f} s while starting and is not "
                    f"healthy: serve.startup_timeout = {self.startup_timeout:g} is the longest a starting server "
                    f"may go without a new log line (raise it for a longer silent step, e.g. a model downloaded "
                    f"from the Hub); log {self.log_path}:\n{self.log_tail(40)}")
            if now - start > self.startup_ceiling:
                raise ServerError(
                    f"{self.name} not healthy after {now - start:.0f} s although its log kept growing: a start may "
                    f"take at most {self.startup_ceiling_factor:g} x serve.startup_timeout "
                    f"({self.startup_timeout:g} s) in all; log {self.log_path}:\n{self.log_tail(40)}")
            if now - last_said >= self.progress_every:
                last_said = now
                log.info("%s on port %d still starting (%.0f s): %s", self.name, self.port, now - start,
                         printable(self.last_log_line()))
            time.sleep(0.2)

    @property
    def startup_ceiling(self) -> float:
        """Seconds a start may take in all, however busy its log."""
        return self.startup_ceiling_factor * self.startup_timeout

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size if self.log_path else 0
        except OSError:
            return 0

    def last_log_line(self, limit: int = 160) -> str:
        """The log's last non-blank line, read from its last few KB; a progress bar's redraws (carriage returns)
        count as lines, so the newest one is what it shows."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                tail = f.read().decode(errors="replace")
        except (OSError, TypeError):
            return ""
        lines = [line.strip() for line in tail.replace("\r", "\n").split("\n") if line.strip()]
        return lines[-1][:limit] if lines else ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal(proc, signal.SIGKILL)  # whatever of its group is left, the leader included
        proc.wait()

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def answers(self) -> bool:
        """Alive and taking connections: a process that is alive but refuses them is as good as dead; a slow
        answer is not."""
        if not self.is_alive():
            return False
        try:
            httpx.get(f"{self.url}/health", timeout=30)
        except httpx.TransportError as e:
            return isinstance(e, httpx.TimeoutException)
        return True

    def restart(self, adapters: dict[str, Path]) -> None:
        """Stopped and started again on its port, serving `adapters` (name -> directory) again."""
        self.stop()
        self.start()
        for name, path in adapters.items():
            self.load_adapter(name, str(path))

    def log_tail(self, n: int = 50) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))

    # -------------------------------------------------------------------------------------------- adapters

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        if replace:  # vLLM added load_inplace later; leave it out when it is not needed
            body["load_inplace"] = True
        self._request("POST", "/v1/load_lora_adapter", json=body)

    def unload_adapter(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def _request(self, method: str, route: str, **kw) -> httpx.Response:
        if self._proc is not None and not self.is_alive():  # fail fast: someone else may hold the port by now
            raise ServerError(f"{route}: the {self.name} exited with code {self._proc.returncode}")
        return control_request(method, f"{self.url}{route}", api_key=self.api_key, who=self.name, **kw)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
