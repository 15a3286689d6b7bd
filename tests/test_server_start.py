"""A server's start follows its progress, not a fixed deadline (servers/process.py, every backend's path): a real
process on 127.0.0.1 (tests/vllm_stand_in.py run as VLLMServer's program) that writes its log slowly is waited
for past serve.startup_timeout; one that goes silent is stopped with a line naming serve.startup_timeout; one
that exits is named with its log's end; one whose log grows forever meets the ceiling. Each bounded in seconds."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_sdk.servers import ServerError
from lightning_sdk.servers.vllm import ENGINE_READY_TIMEOUT, VLLMServer

STAND_IN = [sys.executable, str(Path(__file__).with_name("vllm_stand_in.py"))]
TIMEOUT = 1.5  # serve.startup_timeout in these tests: seconds of silence allowed


def stand_in(tmp_path: Path, monkeypatch, **env: str) -> VLLMServer:
    monkeypatch.setenv("STAND_IN_RECORD", str(tmp_path / "requests.jsonl"))
    for name in ("STAND_IN_LOAD_S", "STAND_IN_PROGRESS_S", "STAND_IN_PROGRESS_BAR", "STAND_IN_HANG_S", "STAND_IN_EXIT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return VLLMServer(str(model), served_model_name="p", lora_r=8, sleep_level=0, startup_timeout=TIMEOUT,
                      log_path=tmp_path / "server.log", launcher=STAND_IN)


@pytest.mark.parametrize("bar", [False, True], ids=["lines", "progress bar"])
def test_a_start_that_keeps_logging_is_waited_for_past_the_timeout(tmp_path, monkeypatch, caplog, bar):
    server = stand_in(tmp_path, monkeypatch, STAND_IN_LOAD_S=str(3 * TIMEOUT), STAND_IN_PROGRESS_S="0.3",
                      **({"STAND_IN_PROGRESS_BAR": "1"} if bar else {}))
    server.progress_every = 1.0
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="lightning_sdk"):
        server.start()
    try:
        assert time.monotonic() - t0 > 3 * TIMEOUT and server.is_alive()
    finally:
        server.stop()
    said = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
    assert said and all(m.startswith(f"vLLM server on port {server.port} still starting (") for m in said)
    # the log's last line, a bar's redraw included, one line with no control character
    assert all("Loading weights: step " in m and "\r" not in m and "\n" not in m for m in said)


def test_a_silent_start_stops_naming_the_setting(tmp_path, monkeypatch):
    server = stand_in(tmp_path, monkeypatch, STAND_IN_LOAD_S="60")
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        server.start()
    took = time.monotonic() - t0
    message = str(e.value)
    assert TIMEOUT < took < TIMEOUT + 10 and not server.is_alive()
    assert re.match(r"vLLM server wrote nothing to its log for \d+ s while starting and is not healthy: "
                    r"serve\.startup_timeout = 1\.5 is the longest a starting server may go without a new log line",
                    message)
    assert f"log {tmp_path / 'server.log'}:\nstand-in: loading" in message
    left = subprocess.run(["pgrep", "-f", "--", f"--port {server.port} "], capture_output=True, text=True)
    assert left.returncode == 1 and left.stdout == ""  # 1: no process matched (2 would be pgrep's own error)


def test_a_server_that_goes_silent_after_progress_is_stopped_too(tmp_path, monkeypatch):
    # A line every 0.3 s for 3 s, then silence: it counts from the last line, not from the start.
    server = stand_in(tmp_path, monkeypatch, STAND_IN_LOAD_S=str(2 * TIMEOUT), STAND_IN_PROGRESS_S="0.3",
                      STAND_IN_HANG_S="60")
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"wrote nothing to its log for \d+ s(.|\n)*serve\.startup_timeout = 1\.5"
                                          r"(.|\n)*Loading weights: step \d+\n$"):
        server.start()
    assert 3 * TIMEOUT < time.monotonic() - t0 < 3 * TIMEOUT + 10 and not server.is_alive()


def test_a_server_that_exits_while_starting_is_named_with_its_log_s_end(tmp_path, monkeypatch):
    server = stand_in(tmp_path, monkeypatch, STAND_IN_LOAD_S="0.6", STAND_IN_PROGRESS_S="0.2", STAND_IN_EXIT="3")
    with pytest.raises(ServerError) as e:
        server.start()
    message = str(e.value)
    assert message.startswith(f"vLLM server exited with code 3 while starting; log {tmp_path / 'server.log'}:\n")
    assert message.rstrip().endswith("RuntimeError: the engine core died while starting")
    assert "serve.startup_timeout" not in message


def test_a_log_that_grows_forever_meets_the_ceiling(tmp_path, monkeypatch):
    server = stand_in(tmp_path, monkeypatch, STAND_IN_LOAD_S="60", STAND_IN_PROGRESS_S="0.2")
    server.startup_ceiling_factor = 2  # 3 s in all
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        server.start()
    assert 2 * TIMEOUT < time.monotonic() - t0 < 2 * TIMEOUT + 10 and not server.is_alive()
    assert str(e.value).startswith("vLLM server not healthy after 3 s although its log kept growing: a start may "
                                   "take at most 2 x serve.startup_timeout (1.5 s) in all; log ")


def test_vllm_s_own_engine_wait_gets_the_ceiling_unless_set(monkeypatch):
    server = VLLMServer("m", served_model_name="p", lora_r=8)
    monkeypatch.delenv(ENGINE_READY_TIMEOUT, raising=False)
    assert server.environment()[ENGINE_READY_TIMEOUT] == "3600"  # 12 x 300: vLLM's default 600 would stop it first
    monkeypatch.setenv(ENGINE_READY_TIMEOUT, "900")
    assert ENGINE_READY_TIMEOUT not in server.environment()  # the user's own value reaches vLLM as it is
