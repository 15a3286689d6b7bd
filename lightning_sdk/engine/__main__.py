"""`python -m lightning_sdk.engine --model builtin:tiny-arith --served-model-name policy --port 8000`"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import threading
import time

from lightning_sdk.config import VLLM_REASONING_PARSERS, VLLM_TOOL_CALL_PARSERS


def _exit_with_parent(pid: int) -> None:
    """A runtime killed with SIGKILL cannot stop its server: leave by ourselves, freeing the port and memory."""
    while os.getppid() == pid:
        time.sleep(0.5)
    logging.getLogger("lightning_sdk.servers").warning("parent process %d is gone: shutting down", pid)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown
    time.sleep(15)
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lightning_sdk.engine",
                                description="OpenAI-compatible chat-completions server on transformers (CPU)")
    p.add_argument("--model", required=True, help="builtin:NAME, a model directory or a hub id")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("LIGHTNING_SDK_SERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 (default: $LIGHTNING_SDK_SERVE_API_KEY)")
    p.add_argument("--max-batch-size", type=int, default=64, help="most sequences decoded together")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens, at most (default: the model's max_position_embeddings)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default="none", choices=["none", "4bit"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda or cuda:N")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *VLLM_TOOL_CALL_PARSERS],
                   metavar="NAME", help="the tool-call format, by vLLM's parser name (serve.tool_call_parser): "
                   "'auto' (the model's own), 'none' or a name")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *VLLM_REASONING_PARSERS],
                   metavar="NAME", help="the reasoning split, by vLLM's parser name (serve.reasoning_parser): "
                   "'auto' (the model's own), 'none' or a name")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the runtime) is gone")
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--header-timeout", type=float, default=None,
                   help="seconds a client has to send a request's headers, then it is disconnected (default 15)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at once; more get 503 and are closed (default 1000)")
    args = p.parse_args(argv)
    if args.api_key == "":
        p.error("--api-key / $LIGHTNING_SDK_SERVE_API_KEY is empty: give a key, or unset it for a server without one")
    if args.header_timeout is not None and args.header_timeout <= 0:
        p.error(f"--header-timeout must be above 0 (got {args.header_timeout})")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device must be cpu, cuda or cuda:N (got {args.device!r})")
    if args.max_connections is not None and args.max_connections < 1:
        p.error(f"--max-connections must be at least 1 (got {args.max_connections})")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lightning_sdk.console import drop_known_noise

    drop_known_noise()  # before peft imports bitsandbytes
    if args.parent_pid:
        threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    import torch
    import uvicorn

    from lightning_sdk import models
    from lightning_sdk.engine.app import create_app
    from lightning_sdk.engine.engine import Engine
    from lightning_sdk.gateway.guard import (DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, connection_cap,
                                             guarded_protocol)

    if args.threads:
        torch.set_num_threads(args.threads)
    # The runtime follows a start by its log (servers/process.py): say what the silent load ahead is.
    logging.getLogger("lightning_sdk.servers").info("loading %s on %s", args.model, args.device)
    engine = Engine(models.resolve(args.model), dtype=args.dtype, quantization=args.quantization,
                    max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, seed=args.seed,
                    device=args.device, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser)
    app = create_app(engine, served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                     **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}))
    if args.api_key is None:
        logging.getLogger("lightning_sdk.servers").warning(
            "no API key: any local user can call every route, adapter loads included (lightning run always sets one)")
    protocol = guarded_protocol(header_timeout=args.header_timeout or DEFAULT_HEADER_TIMEOUT,
                                max_connections=connection_cap(args.max_connections or DEFAULT_MAX_CONNECTIONS))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False,
                timeout_graceful_shutdown=5, http=protocol)


if __name__ == "__main__":
    main()
