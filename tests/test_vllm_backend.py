"""The vLLM backend on CPU: command line, config mapping, backend choice, and the process/HTTP side against a real
local server standing in for vLLM's control routes (tests/vllm_stand_in.py). Generation through real vLLM is in
tests/gpu (CUDA only)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from lightning_sdk import config
from lightning_sdk.errors import SetupError
from lightning_sdk.runtime import gpu_handover
from lightning_sdk.servers import InferenceServer, ServerError, SleepableServer
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.servers.select import make_server, vllm_server
from lightning_sdk.servers.vllm import VLLMServer, max_lora_rank, vllm_command, vllm_environment

STAND_IN = [sys.executable, str(Path(__file__).with_name("vllm_stand_in.py"))]
KEY = "sk-test-secret"


def make_cfg(tmp_path: Path, **serve) -> config.Config:
    return config.parse({"agent": {"module": "agent.py"}, "data": {"train": "tasks.jsonl"},
                         "model": {"name": "my-model", "dtype": "bfloat16"}, "train": {"lora_r": 20},
                         "serve": serve, "run": {"dir": str(tmp_path / "run")}})


# ------------------------------------------------------------------------------------ command line and config


def test_command_line():
    cmd = vllm_command("/models/qwen", served_model_name="policy", host="127.0.0.1", port=8123, lora_r=16,
                       max_loras=3, dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.45,
                       extra_args=["--enforce-eager"])
    assert cmd == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/models/qwen",
                   "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "8123",
                   "--dtype", "bfloat16", "--max-model-len", "4096", "--gpu-memory-utilization", "0.45",
                   "--enable-lora", "--max-lora-rank", "16", "--max-loras", "3",
                   "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                   "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
                   "--enable-sleep-mode", "--enforce-eager"]
    no_sleep = vllm_command("m", served_model_name="p", host="h", port=1, lora_r=8, sleep=False, launcher=["vllm",
                                                                                                          "serve"])
    assert no_sleep[:3] == ["vllm", "serve", "m"] and "--enable-sleep-mode" not in no_sleep


def test_lora_rank_rounds_up_to_a_rank_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 16, 17, 64, 300, 512)] == [1, 8, 8, 16, 32, 64, 320, 512]
    with pytest.raises(ServerError, match="train.lora_r = 513"):
        max_lora_rank(513)


def test_environment_carries_the_key_and_the_runtime_routes():
    strict = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "1"}  # the structural tags the trainer replays, always
    assert vllm_environment(KEY) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1",
                                     "VLLM_API_KEY": KEY, **strict}
    assert vllm_environment(None, sleep=False) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **strict}


def test_config_maps_onto_the_server(tmp_path):
    cfg = make_cfg(tmp_path, backend="vllm", port=9001, api_key=KEY, max_model_len=1024,
                   gpu_memory_utilization=0.3, max_loras=4, sleep_level=0, extra_args=["--enforce-eager"])
    server = vllm_server(cfg, "/models/qwen", tmp_path / "server.log")
    assert isinstance(server, InferenceServer) and isinstance(server, SleepableServer) and not server.can_sleep
    cmd = server.command()
    flags = dict(zip(cmd, cmd[1:]))  # each flag -> the word after it
    assert cmd[4] == "/models/qwen" and KEY not in cmd
    # serve.host/port/api_key are the gateway's (what agents call): vLLM listens on loopback with a key of its own
    assert flags["--served-model-name"] == "my-model" and flags["--host"] == "127.0.0.1" and flags["--port"] != "9001"
    assert flags["--max-lora-rank"] == "32" and flags["--max-loras"] == "4"  # lora_r 20 -> 32
    assert flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "1024"
    assert flags["--gpu-memory-utilization"] == "0.3"
    assert "--enable-sleep-mode" not in cmd and cmd[-1] == "--enforce-eager"
    assert server.environment()["VLLM_API_KEY"] == server.api_key and server.api_key != KEY


@pytest.mark.parametrize("serve, key", [
    ({"sleep_level": 2}, "serve.sleep_level"),
    ({"gpu_memory_utilization": 1.5}, "serve.gpu_memory_utilization"),
    ({"max_loras": 0}, "serve.max_loras"),
    ({"extra_args": ["--port=9", "--enforce-eager"]}, "serve.extra_args"),
    ({"gpu_mem": 0.5}, "serve.gpu_mem: unknown key"),
])
def test_bad_serve_keys_are_named(tmp_path, serve, key):
    with pytest.raises(config.ConfigError, match=key.replace(".", r"\.")):
        make_cfg(tmp_path, **serve)


def test_importance_sampling_cap_is_validated(tmp_path):
    with pytest.raises(config.ConfigError, match=r"train\.importance_sampling_cap"):
        config.parse({"agent": {"module": "a.py"}, "data": {"train": "t.jsonl"},
                      "train": {"importance_sampling_cap": 0.5}})


# ---------------------------------------------------------------------------------------------- backend choice
# This test environment has no vllm (it must not: it pins its own torch), so these take the "not installed" path.


def test_auto_falls_back_to_the_cpu_server_and_says_why(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_sdk"):
        server = make_server(make_cfg(tmp_path, backend="auto"), "/models/qwen", tmp_path / "server.log")
    assert isinstance(server, CPUServer) and not server.is_alive()
    lines = [r.getMessage() for r in caplog.records if "serve.backend" in r.getMessage()]
    assert len(lines) == 1
    assert "using the built-in CPU server (the vllm package is not installed" in lines[0]


def test_vllm_backend_without_vllm_is_a_setup_error(tmp_path):
    with pytest.raises(SetupError, match=r"serve.backend = 'vllm'.*pip install 'lightning-agent-rl\[gpu\]'"):
        make_server(make_cfg(tmp_path, backend="vllm"), "/models/qwen", tmp_path / "server.log")


def test_cli_names_the_backend_and_the_extra(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "lightning.toml").write_text(f"""
[agent]
module = "{root / 'cookbook/arith/agent.py'}"
[data]
train = "{root / 'cookbook/arith/data/train.jsonl'}"
[serve]
backend = "vllm"
""")
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "run"], cwd=tmp_path, text=True,
                         capture_output=True, timeout=120, env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "serve.backend = 'vllm'" in out.stdout and "pip install 'lightning-agent-rl[gpu]'" in out.stdout


# ------------------------------------------------------------------------- the process, against the stand-in


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    """A started VLLMServer whose program is the stand-in; yields (server, request record path)."""
    record = tmp_path / "requests.jsonl"
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    monkeypatch.setenv("STAND_IN_LOAD_S", "0.5")  # /health answers only after this
    model = tmp_path / "model"
    model.mkdir()
    server = VLLMServer(str(model), served_model_name="policy", lora_r=16, api_key=KEY, startup_timeout=30,
                        log_path=tmp_path / "server.log", launcher=STAND_IN)
    server.start()
    yield server, record
    server.stop()


def test_start_waits_for_health_and_keeps_the_key_out_of_argv(stand_in):
    server, record = stand_in
    assert server.is_alive() and server.port > 0
    first, health = records(record)[:2]
    assert first["argv"][:3] == [server.model, "--served-model-name", "policy"] and KEY not in first["argv"]
    assert health["path"] == "/health"


def test_adapter_load_and_unload_requests(stand_in, tmp_path):
    server, record = stand_in
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    server.load_adapter("run-iter1", str(adapter))
    server.load_adapter("run-iter1", str(adapter), replace=True)
    server.unload_adapter("run-iter1")
    sent = [r for r in records(record) if r.get("path", "").startswith("/v1/")]
    assert [(r["path"], r["body"]) for r in sent] == [
        ("/v1/load_lora_adapter", {"lora_name": "run-iter1", "lora_path": str(adapter)}),
        ("/v1/load_lora_adapter", {"lora_name": "run-iter1", "lora_path": str(adapter), "load_inplace": True}),
        ("/v1/unload_lora_adapter", {"lora_name": "run-iter1"}),
    ]
    assert all(r["auth"] == f"Bearer {KEY}" for r in sent)
    with pytest.raises(ServerError, match="load_lora_adapter failed \\(404\\): No adapter found"):
        server.load_adapter("missing", str(tmp_path / "nowhere"))
    with pytest.raises(ServerError, match="cannot be found"):
        server.unload_adapter("run-iter1")


def test_sleep_and_wake_around_the_update(stand_in):
    server, record = stand_in
    timings: dict[str, float] = {}
    with gpu_handover(server, timings):
        assert server.is_sleeping()
    assert not server.is_sleeping()
    assert set(timings) == {"sleep_s", "wake_s"} and all(v >= 0 for v in timings.values())
    sent = [(r["method"], r["path"], r["query"]) for r in records(record)[1:] if r["path"] != "/health"]
    assert sent == [("POST", "/sleep", {"level": ["1"]}), ("GET", "/is_sleeping", {}), ("POST", "/wake_up", {}),
                    ("GET", "/is_sleeping", {})]


def test_servers_that_cannot_sleep_are_left_alone(tmp_path):
    timings: dict[str, float] = {}
    awake = VLLMServer("m", served_model_name="p", lora_r=8, sleep_level=0)
    for server in (CPUServer("m", served_model_name="p"), awake):
        with gpu_handover(server, timings):  # neither is started: a request would fail
            pass
    assert timings == {} and not isinstance(CPUServer("m", served_model_name="p"), SleepableServer)
    with pytest.raises(ServerError, match="sleep_level = 0"):
        awake.sleep()


def test_crash_while_starting_reports_exit_code_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_RECORD", str(tmp_path / "requests.jsonl"))
    server = VLLMServer(str(tmp_path / "no-such-model"), served_model_name="p", lora_r=8, startup_timeout=30,
                        log_path=tmp_path / "server.log", launcher=STAND_IN)
    with pytest.raises(ServerError, match=r"vLLM server exited with code 1 while starting(.|\n)*no-such-model"
                                          r"' not found"):
        server.start()
    assert not server.is_alive()


def test_stop_ends_the_server(stand_in):
    server, _ = stand_in
    proc = server._proc
    server.stop()
    assert proc.poll() is not None and not server.is_alive()
    server.stop()  # twice is fine


def test_config_refuses_every_flag_vllm_command_sets():
    from lightning_sdk.config import VLLM_MANAGED_FLAGS
    from lightning_sdk.servers.vllm import vllm_command

    cmd = vllm_command("/m", served_model_name="m", host="127.0.0.1", port=1, lora_r=8, sleep=True)
    assert {a for a in cmd if a.startswith("--")} <= set(VLLM_MANAGED_FLAGS)


# ------------------------------------------------------------------------ tool-call and reasoning parsers

TEMPLATES = {  # the markers each family's chat template carries (abridged from the published templates)
    "qwen2.5": ("qwen2", '{{- "<tool_call>\\n{\\"name\\": <function-name>, ...}\\n</tool_call>" }}'),
    "qwen3": ("qwen3", '<tool_call>{{ tool_call | tojson }}</tool_call>{% if enable_thinking %}<think>{% endif %}'),
    "qwen3-coder": ("qwen3_moe", "<tool_call>\n<function={{ name }}>\n<parameter=x>"),
    "llama3.1": ("llama", '{{- "<|python_tag|>" + tool_call.arguments }} {%- if tools is not none %}'),
    "llama3.2": ("llama", '{%- if tools is not none %}{{- "Given the following functions ..." }}{%- endif %}'),
    "mistral": ("mistral", "{{- '[TOOL_CALLS] [' }}"),
    "deepseek-r1-distill-qwen": ("qwen2", "{{'<｜Assistant｜><think>\\n'}}"),
    "gpt-oss": ("gpt_oss", "<|channel|>analysis<|message|>"),
    "gemma3": ("gemma3_text", "{{ '<start_of_turn>' + role + '\\n' }}"),
    "gemma3-multimodal": ("gemma3", "{{ '<start_of_turn>' + role + '\\n' }}"),
    "functiongemma": ("gemma3_text", "<start_function_declaration>declaration:{{ name }}<start_function_call>"),
    "gpt2": ("gpt2", "{% for m in messages %}{{ m.content }}{% endfor %}"),
}


@pytest.mark.parametrize("family, tools, reasoning", [
    ("qwen2.5", "hermes", None), ("qwen3", "hermes", "qwen3"), ("qwen3-coder", "qwen3_coder", None),
    ("llama3.1", "llama3_json", None), ("llama3.2", "llama3_json", None), ("mistral", "mistral", None),
    ("deepseek-r1-distill-qwen", None, "deepseek_r1"), ("gpt-oss", "openai", "openai_gptoss"), ("gpt2", None, None),
    ("gemma3", "pythonic", None), ("gemma3-multimodal", "pythonic", None), ("functiongemma", "functiongemma", None),
])
def test_parsers_follow_the_model(family, tools, reasoning):
    from lightning_sdk.models.tool_parsers import reasoning_parser_for, tool_call_parser_for

    model_type, template = TEMPLATES[family]
    assert (tool_call_parser_for(template, model_type), reasoning_parser_for(template, model_type)) == \
           (tools, reasoning)


def test_builtin_models_get_the_hermes_parser(tmp_path, tiny_model_path):
    cfg = make_cfg(tmp_path, backend="vllm", sleep_level=0)
    cmd = vllm_server(cfg, tiny_model_path, tmp_path / "server.log").command()
    # every tool's arguments pinned to its schema, strict or not: the grammar the trainer replays (constraint.py)
    assert cmd[cmd.index("--enable-auto-tool-choice"):][:5] == ["--enable-auto-tool-choice", "--tool-call-parser",
                                                              "hermes", "--tool-strict-level", "parameter"]
    assert "--reasoning-parser" not in cmd


def test_parser_settings_override_and_are_validated(tmp_path, tiny_model_path, caplog):
    cfg = make_cfg(tmp_path, backend="vllm", tool_call_parser="llama3_json", reasoning_parser="deepseek_r1")
    flags = dict(zip(cmd := vllm_server(cfg, tiny_model_path, tmp_path / "s.log").command(), cmd[1:]))
    assert flags["--tool-call-parser"] == "llama3_json" and flags["--reasoning-parser"] == "deepseek_r1"
    off = vllm_server(make_cfg(tmp_path, tool_call_parser="none"), tiny_model_path, tmp_path / "s.log").command()
    assert "--enable-auto-tool-choice" not in off and "--tool-call-parser" not in off
    with pytest.raises(config.ConfigError, match=r"serve\.tool_call_parser.*'hermez' is not one of vLLM's parsers"):
        make_cfg(tmp_path, tool_call_parser="hermez")
    with pytest.raises(config.ConfigError, match=r"serve\.reasoning_parser.*'r1'"):
        make_cfg(tmp_path, reasoning_parser="r1")
    with pytest.raises(config.ConfigError, match=r"serve\.extra_args"):
        make_cfg(tmp_path, extra_args=["--tool-call-parser", "hermes"])
    with pytest.raises(config.ConfigError, match=r"serve\.extra_args.*--tool-strict-level"):
        make_cfg(tmp_path, extra_args=["--tool-strict-level=auto"])
    # A model whose format nothing here knows: one line at start, naming the key to set.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"model_type": "gpt2"}')
    with caplog.at_level(logging.INFO, logger="lightning_sdk"):
        cmd = vllm_server(make_cfg(tmp_path), str(plain), tmp_path / "s.log").command()
    assert "--tool-call-parser" not in cmd
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "no vLLM tool-call parser fits" in warned[0] and "serve.tool_call_parser" in warned[0]


def test_the_cpu_build_is_allowed_by_name_and_refuses_sleep_mode(tmp_path, monkeypatch):
    import importlib.util

    from lightning_sdk.servers import vllm as vllm_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert vllm_module.vllm_unavailable_reason(cpu_build=True) is None
    if not __import__("torch").cuda.is_available():  # 'auto' and the GPU path still want CUDA
        assert vllm_module.vllm_unavailable_reason() == "no CUDA GPU is visible to torch"
    with pytest.raises(SetupError, match=r"serve\.sleep_level = 1: vLLM's CPU build .* set serve\.sleep_level = 0"):
        make_server(make_cfg(tmp_path, backend="vllm"), "/models/qwen", tmp_path / "server.log")
    assert isinstance(make_server(make_cfg(tmp_path, backend="vllm", sleep_level=0), "/models/qwen",
                                  tmp_path / "server.log"), VLLMServer)


@pytest.mark.parametrize("args", [["--quantization", "bitsandbytes"], ["--quantization=bitsandbytes"],
                                  ["--enforce-eager", "-q", "bitsandbytes"], ["-qbitsandbytes"]])
def test_a_quantization_vllm_does_not_know_is_refused(tmp_path, args):
    with pytest.raises(config.ConfigError) as e:
        make_cfg(tmp_path, extra_args=args)
    line = str(e.value)
    assert "\n" not in line and line.startswith("serve.extra_args: --quantization 'bitsandbytes' is not one of "
                                                "vLLM's quantization methods; expected one of awq, auto_awq, fp8,")
    assert make_cfg(tmp_path, extra_args=["--quantization", "fp8", "-q=awq_marlin"]).serve.extra_args
