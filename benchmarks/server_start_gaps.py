"""How a server's start looks from outside: the time to /health and the longest stretch its log did not grow.

    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 /work/ci-clone/.venv-vllm/bin/python \
        benchmarks/server_start_gaps.py vllm      # vLLM's CPU build on the builtin tiny model
    PYTHONPATH=. python benchmarks/server_start_gaps.py cpu   # the built-in server

serve.startup_timeout is the longest a starting server may go without writing to its log (servers/process.py):
the longest silence measured here is what that default must leave room for. It prints the three longest
silences with the log line each followed, then the longest against the time to /health (ratio=).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_sdk import models  # noqa: E402
from lightning_sdk.servers.cpu import CPUServer  # noqa: E402
from lightning_sdk.servers.vllm import VLLMServer  # noqa: E402


def last_line(path: Path) -> str:
    data = path.read_bytes()[-2000:].decode(errors="replace").replace("\r", "\n")
    lines = [x for x in data.split("\n") if x.strip()]
    return lines[-1][:120] if lines else ""


def main(backend: str) -> None:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("lightning_sdk").setLevel(logging.INFO)  # the "still starting" lines, as `lightning run` shows
    model = models.resolve("builtin:tiny-arith")
    work = Path(tempfile.mkdtemp(prefix="start-gaps-"))
    log = work / "server.log"
    if backend == "vllm":
        server = VLLMServer(model, served_model_name="tiny", lora_r=8, max_model_len=512, dtype="bfloat16",
                            sleep_level=0, startup_timeout=900, log_path=log)
        server.progress_every = 10.0
    else:
        server = CPUServer(model, served_model_name="tiny", startup_timeout=900, log_path=log)
    done = threading.Event()
    t0 = time.monotonic()
    starter = threading.Thread(target=lambda: (server.start(), done.set()), daemon=True)
    starter.start()
    size, last_growth, before, gaps = 0, t0, "(start)", []  # gaps: (silence in s, the line it followed)
    while not done.is_set() and starter.is_alive():
        now = time.monotonic()
        n = log.stat().st_size if log.exists() else 0
        if n != size:
            gaps.append((now - last_growth, before))
            size, last_growth, before = n, now, last_line(log)
        time.sleep(0.1)
    healthy = time.monotonic() - t0
    gaps.append((time.monotonic() - last_growth, f"{before} (until /health)"))
    server.stop()
    if not done.is_set():
        sys.exit(f"the server did not start; log {log}")
    print(f"{backend}: healthy after {healthy:.1f} s; the log grew {len(gaps) - 1} times; longest silences "
          f"(load average {os.getloadavg()[0]:.1f}):")
    for gap, line in sorted(gaps, reverse=True)[:3]:
        print(f"  {gap:6.1f} s after: {line}")
    longest = max(g for g, _ in gaps)
    print(f"longest_silence_s={longest:.1f} healthy_s={healthy:.1f} ratio={longest / healthy:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vllm")
