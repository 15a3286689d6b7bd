"""Inference servers as the runtime sees them: an OpenAI-compatible base URL plus LoRA hot-swapping.

`CPUServer` runs the built-in transformers server (`python -m lightning_sdk.serving`) in a subprocess; a vLLM
server speaks the same HTTP API (including `/v1/load_lora_adapter`), so it can sit behind the same protocol.
This module stays light: torch and transformers are imported only in the server process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Protocol, runtime_checkable

import httpx


class ServerError(RuntimeError):
    """The inference server failed to start, died, or refused an adapter operation."""


@runtime_checkable
class InferenceServer(Protocol):
    base_url: str  # ".../v1", for openai.OpenAI(base_url=...)
    api_key: str | None
    served_model_name: str

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def is_alive(self) -> bool: ...
    def load_adapter(self, name: str, path: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    def log_tail(self, n: int = 50) -> str: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class CPUServer:
    """The built-in CPU server in a subprocess. `with CPUServer(...) as server:` starts and stops it."""

    def __init__(self, model: str, *, served_model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_batch_size: int = 64, max_model_len: int = 2048,
                 dtype: str = "auto", quantization: str = "none", threads: int | None = None,
                 startup_timeout: float = 120, log_path: str | Path | None = None):
        self.model = model
        self.served_model_name = served_model_name
        self.host = host
        self.port = port
        self.api_key = api_key
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.quantization = quantization
        self.threads = threads
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

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
        cmd = [sys.executable, "-m", "lightning_sdk.serving", "--model", self.model,
               "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
               "--max-batch-size", str(self.max_batch_size), "--max-model-len", str(self.max_model_len),
               "--dtype", self.dtype, "--quantization", self.quantization, "--parent-pid", str(os.getpid())]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.api_key:
            # Through the environment, not argv, so the key does not show up in `ps`.
            env["LIGHTNING_SDK_SERVE_API_KEY"] = self.api_key
        # The child must import this package even when it is not installed and the cwd is elsewhere.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env)
        try:
            self._wait_healthy()
        except BaseException:  # includes Ctrl-C while waiting: never leave the child behind
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.is_alive():
                code = self._proc.returncode if self._proc else None
                raise ServerError(f"inference server exited with code {code} while starting; "
                                  f"log {self.log_path}:\n{self.log_tail(40)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ServerError(f"inference server not healthy after {self.startup_timeout:.0f}s; "
                          f"log {self.log_path}:\n{self.log_tail(40)}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n: int = 50) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))

    def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": replace})

    def unload_adapter(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def _post(self, route: str, body: dict) -> None:
        if self._proc is not None and not self.is_alive():  # fail fast: someone else may hold the port by now
            raise ServerError(f"{route}: the inference server exited with code {self._proc.returncode}")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.post(f"{self.url}{route}", json=body, headers=headers, timeout=120)
        except httpx.HTTPError as e:
            raise ServerError(f"{route}: inference server unreachable ({e})") from e
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise ServerError(f"{route} failed ({r.status_code}): {message}")

    def __enter__(self) -> CPUServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
