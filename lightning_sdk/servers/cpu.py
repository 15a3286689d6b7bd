"""The built-in CPU server (`python -m lightning_sdk.engine`, transformers) as a managed subprocess."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning_sdk.constraint import ServerGrammar
from lightning_sdk.servers.process import ServerProcess


class CPUServer(ServerProcess):
    """The built-in CPU server in a subprocess. `with CPUServer(...) as server:` starts and stops it."""

    def __init__(self, model: str, *, served_model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_batch_size: int = 64, max_model_len: int | None = None,
                 dtype: str = "auto", quantization: str = "none", threads: int | None = None,
                 startup_timeout: float = 300, log_path: str | Path | None = None,
                 header_timeout: float | None = None, max_connections: int | None = None, device: str = "cpu",
                 seed: int = 0, tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
        super().__init__(served_model_name=served_model_name, host=host, port=port, api_key=api_key,
                         startup_timeout=startup_timeout, log_path=log_path)
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.quantization = quantization
        self.threads = threads
        self.header_timeout = header_timeout  # None: the server's defaults (gateway/guard.py)
        self.max_connections = max_connections
        self.device = device
        self.seed = seed  # of the sampler's random stream (requests without a seed of their own)
        # serve.tool_call_parser / serve.reasoning_parser: 'auto' (the model's own), 'none' or a vLLM parser name
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self._grammar: ServerGrammar | None = None

    @property
    def grammar(self) -> ServerGrammar:
        """What this server applies to a constraint (the engine reads the same settings the same way)."""
        if self._grammar is None:
            from lightning_sdk import models
            from lightning_sdk.models.tool_parsers import server_grammar

            self._grammar = server_grammar(models.resolve(self.model), self.tool_call_parser, self.reasoning_parser,
                                           compact=True)
        return self._grammar

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "lightning_sdk.engine", "--model", self.model,
               "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
               "--max-batch-size", str(self.max_batch_size),
               *(["--max-model-len", str(self.max_model_len)] if self.max_model_len is not None else []),
               "--dtype", self.dtype, "--quantization", self.quantization, "--seed", str(self.seed),
               "--tool-call-parser", self.tool_call_parser, "--reasoning-parser", self.reasoning_parser,
               "--parent-pid", str(os.getpid())]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if self.device != "cpu":
            cmd += ["--device", self.device]
        if self.header_timeout is not None:
            cmd += ["--header-timeout", f"{self.header_timeout:g}"]
        if self.max_connections is not None:
            cmd += ["--max-connections", str(self.max_connections)]
        return cmd

    def environment(self) -> dict[str, str]:
        # The child must import this package even when it is not installed and the cwd is elsewhere.
        root = str(Path(__file__).resolve().parents[2])
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        if self.api_key:
            env["LIGHTNING_SDK_SERVE_API_KEY"] = self.api_key  # not argv: the key must not show up in `ps`
        return env
