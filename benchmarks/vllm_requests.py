"""What agents send, against vLLM as a run starts it (servers/select.vllm_server) behind the run's gateway: the
status of each request form, whether a tool call came back parsed, and whether the gateway's record holds the
exact sampled token ids.

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD /tmp/lightning-vllm-cpu/bin/python \\
        benchmarks/vllm_requests.py [MODEL]       # default: the calc cookbook's tiny model (Hermes tool calls)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_sdk import config, models  # noqa: E402
from lightning_sdk.gateway.proxy import Gateway  # noqa: E402
from lightning_sdk.servers.select import vllm_server  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 12*3-5.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MESSAGES = [{"role": "system", "content": "Solve the problem. Use the calculator, then give the number."},
            {"role": "user", "content": "Ann has 12 boxes with 8 pencils in each. How many pencils does Ann have?"}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
FORMS = {
    "plain chat": {"messages": MESSAGES},
    "tools, no tool_choice": {"messages": MESSAGES, "tools": TOOLS},
    "tools, streamed": {"messages": MESSAGES, "tools": TOOLS, "stream": True},
    'tool_choice "required"': {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"},
    "tool_choice named function": {"messages": MESSAGES, "tools": TOOLS,
                                   "tool_choice": {"type": "function", "function": {"name": "calculator"}}},
    "response_format json_schema": {"messages": MESSAGES, "response_format": SCHEMA},
}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else f"tiny:{ROOT / 'cookbook/calc/teacher.py'}"
    work = Path(tempfile.mkdtemp(prefix="vllm-requests-"))
    cfg = config.parse({"agent": {"module": "agent.py"}, "data": {"train": "t.jsonl"},
                        "model": {"name": "policy", "dtype": "float32"},
                        "serve": {"backend": "vllm", "sleep_level": 0, "max_model_len": 1024, "startup_timeout": 900},
                        "run": {"dir": str(work / "run")}})
    server = vllm_server(cfg, models.resolve(model), work / "server.log")
    t = time.perf_counter()
    with server:
        print(f"vLLM healthy after {time.perf_counter() - t:.0f} s: {' '.join(server.command()[4:])}", flush=True)
        gateway = Gateway(api_key="agents")
        gateway.start([server.url], backend_key=server.api_key, grammar=server.grammar)
        gateway.policy = "policy"
        rows = []
        try:
            with httpx.Client(base_url=gateway.base_url, headers={"Authorization": "Bearer agents"},
                              timeout=300) as http:
                for form, body in FORMS.items():
                    r = http.post("/chat/completions", json={"model": "gpt-4o-mini", "max_tokens": 40,
                                                             "temperature": 0, **body})
                    rows.append((form, r.status_code, describe(r, bool(body.get("stream")))))
                r = http.post("/responses", json={"model": "gpt-4o-mini", "input": MESSAGES[1]["content"],
                                                  "tools": [{"type": "function", **TOOLS[0]["function"]}],
                                                  "max_output_tokens": 40, "temperature": 0})
                items = [o.get("type") for o in r.json().get("output", [])] if r.status_code == 200 else r.text[:160]
                rows.append(("Responses API (tools)", r.status_code, f"output items {items}"))
        finally:
            gateway.stop()
    print("| request | vLLM as the project starts it (through the gateway) |\n|---|---|")
    for form, status, what in rows:
        print(f"| {form} | {status} {what} |")


def describe(r: httpx.Response, stream: bool) -> str:
    if r.status_code != 200:
        return r.text[:200]
    if stream:
        calls = r.text.count('"tool_calls"')
        return f"streamed, {calls} chunks with tool_calls"
    message = r.json()["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return f"tool_calls {calls}" if calls else f"content {message.get('content')!r}"


if __name__ == "__main__":
    main()
