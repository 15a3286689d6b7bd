"""Stand-in for vLLM's OpenAI server, for CPU tests of VLLMServer: real HTTP on 127.0.0.1, control routes only.

It takes the command line `vllm serve` takes (model first, then flags) and serves what VLLMServer itself calls:
/health, /v1/load_lora_adapter, /v1/unload_lora_adapter, /sleep, /wake_up, /is_sleeping, with vLLM's gating
(the LoRA routes need VLLM_ALLOW_RUNTIME_LORA_UPDATING, the sleep routes VLLM_SERVER_DEV_MODE=1 and
--enable-sleep-mode, /v1 needs `Bearer $VLLM_API_KEY` when set). No generation: that needs vLLM and a GPU
(tests/gpu). It appends one JSON line per request to $STAND_IN_RECORD, after a first line with its argv.
A model directory that does not exist makes it exit 1, as vLLM does. Its start (before the port opens) lasts
$STAND_IN_LOAD_S seconds, silent, or with a log line every $STAND_IN_PROGRESS_S seconds (a progress bar's redraw,
as vLLM's weight loading writes, when $STAND_IN_PROGRESS_BAR is set), then $STAND_IN_HANG_S more seconds silent;
$STAND_IN_EXIT makes it exit with that code at the end of its start instead of serving.
"""

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--enable-sleep-mode", action="store_true")
    args, _ = p.parse_known_args()
    record = Path(os.environ["STAND_IN_RECORD"])

    def write(entry: dict) -> None:
        with open(record, "a") as f:
            f.write(json.dumps(entry) + "\n")

    write({"argv": sys.argv[1:]})
    print(f"stand-in: loading {args.model}", flush=True)
    if not Path(args.model).is_dir():
        print(f"ValueError: model {args.model!r} not found", flush=True)
        sys.exit(1)
    load(float(os.environ.get("STAND_IN_LOAD_S", "0")), float(os.environ.get("STAND_IN_PROGRESS_S", "0")),
         bar=bool(os.environ.get("STAND_IN_PROGRESS_BAR")))
    time.sleep(float(os.environ.get("STAND_IN_HANG_S", "0")))
    if os.environ.get("STAND_IN_EXIT"):
        print("RuntimeError: the engine core died while starting", flush=True)
        sys.exit(int(os.environ["STAND_IN_EXIT"]))

    key = os.environ.get("VLLM_API_KEY")
    lora_routes = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    dev_routes = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    adapters: dict[str, str] = {}
    state = {"sleeping": False}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # keep the log for errors
            pass

        def reply(self, status: int, body: dict | None = None) -> None:
            data = json.dumps(body or {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def error(self, status: int, message: str) -> None:
            self.reply(status, {"error": {"message": message, "type": "BadRequestError", "code": status}})

        def handle_any(self, method: str) -> None:
            url = urlparse(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            write({"method": method, "path": url.path, "query": parse_qs(url.query), "body": body,
                   "auth": self.headers.get("Authorization")})
            if url.path.startswith("/v1") and key and self.headers.get("Authorization") != f"Bearer {key}":
                return self.reply(401, {"error": "Unauthorized"})
            route = (method, url.path)
            if route == ("GET", "/health"):
                return self.reply(200)
            if route == ("POST", "/v1/load_lora_adapter") and lora_routes:
                name, path = body.get("lora_name"), body.get("lora_path")
                if name in adapters and not body.get("load_inplace"):
                    return self.error(400, f"The lora adapter '{name}' has already been loaded.")
                if not (Path(path) / "adapter_config.json").exists():
                    return self.error(404, f"No adapter found for {path}")
                adapters[name] = path
                return self.reply(200, {})
            if route == ("POST", "/v1/unload_lora_adapter") and lora_routes:
                if adapters.pop(body.get("lora_name"), None) is None:
                    return self.error(404, f"The lora adapter '{body.get('lora_name')}' cannot be found.")
                return self.reply(200, {})
            if dev_routes and route == ("POST", "/sleep"):
                if not args.enable_sleep_mode:
                    return self.error(500, "Sleep mode is not enabled in the model config")
                state["sleeping"] = True
                return self.reply(200)
            if dev_routes and route == ("POST", "/wake_up"):
                state["sleeping"] = False
                return self.reply(200)
            if dev_routes and route == ("GET", "/is_sleeping"):
                return self.reply(200, {"is_sleeping": state["sleeping"]})
            self.reply(404, {"detail": "Not Found"})

        def do_GET(self):
            self.handle_any("GET")

        def do_POST(self):
            self.handle_any("POST")

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"stand-in: serving on {args.host}:{args.port}", flush=True)
    server.serve_forever()


def load(seconds: float, every: float, *, bar: bool) -> None:
    """The model load, before the port opens: silent, or a line (or a bar's redraw) every `every` seconds."""
    end, step = time.monotonic() + seconds, 0
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, every) if every else left)
        if every:
            step += 1
            line = f"Loading weights: step {step}"
            print(f"\r{line}" if bar else line, end="" if bar else "\n", flush=True)
    if bar:
        print(flush=True)


if __name__ == "__main__":
    main()
