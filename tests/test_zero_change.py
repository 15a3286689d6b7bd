"""An agent written for OpenAI as most are trains with no change but the two decorators: its client is built from
the environment (`OpenAI()`, LangChain's `ChatOpenAI()`, LiteLLM, DSPy, a raw `httpx.post` or `requests.post`, at
import time too), it names its own model, and its @rollout takes only the task. A real short run each (embedded
runtime, tiny model, real server and trainer); the calls are trained from the gateway's records."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import lightning_sdk as ls
from lightning_sdk.errors import RunError
from lightning_sdk.store import Store

ROOT = Path(__file__).resolve().parents[1]
REWARD = '''
@ls.reward
def score(task, output):
    return float(str(output).strip() == task["answer"])
'''
PLAIN = '''
from openai import OpenAI
import lightning_sdk as ls

client = OpenAI()  # at import time, from OPENAI_BASE_URL / OPENAI_API_KEY, as the agent always did

@ls.rollout
def solve(task):
    import os
    assert os.environ["OPENAI_AGENTS_DISABLE_TRACING"] == "1"  # the Agents SDK's upload to OpenAI: off in a run
    out = client.chat.completions.create(model="gpt-4o-mini", max_tokens=8,
                                         messages=[{"role": "user", "content": task["question"]}])
    return out.choices[0].message.content
''' + REWARD
LANGCHAIN = '''
from langchain_openai import ChatOpenAI
import lightning_sdk as ls

chat = ChatOpenAI(model="gpt-4o-mini", max_tokens=8, temperature=1.0)

@ls.rollout
async def solve(task):
    return (await chat.ainvoke(task["question"])).content
''' + REWARD
AGENTS_SDK = '''
from agents import Agent, ModelSettings, Runner
import lightning_sdk as ls

solver = Agent(name="solver", model="gpt-4o-mini", model_settings=ModelSettings(temperature=1.0, max_tokens=8))

@ls.rollout
async def solve(task):
    return (await Runner.run(solver, task["question"])).final_output
''' + REWARD
LITELLM = '''
import litellm
import lightning_sdk as ls

@ls.rollout
def solve(task):
    out = litellm.completion(model="openai/gpt-4o-mini", max_tokens=8,
                             messages=[{"role": "user", "content": task["question"]}])
    return out.choices[0].message.content
''' + REWARD
DSPY = '''
import dspy
import lightning_sdk as ls

lm = dspy.LM("openai/gpt-4o-mini", max_tokens=8, temperature=1.0, cache=False, num_retries=0)

@ls.rollout
def solve(task):
    return lm(messages=[{"role": "user", "content": task["question"]}])[0]
''' + REWARD
RAW_HTTPX = '''
import os
import httpx
import lightning_sdk as ls

@ls.rollout
def solve(task):
    r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", timeout=30,
                   headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
                   json={"model": "gpt-4o-mini", "max_tokens": 8,
                         "messages": [{"role": "user", "content": task["question"]}]})
    return r.json()["choices"][0]["message"]["content"]
''' + REWARD
REQUESTS = RAW_HTTPX.replace("import httpx", "import requests").replace("httpx.post", "requests.post")


def project(tmp_path: Path, source: str, serve: str = "", **agent) -> Path:
    (tmp_path / "agent.py").write_text(source)
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(rows[::25]) + "\n")  # 4 tasks
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in agent.items())
    (tmp_path / "lightning.toml").write_text(f"""
[run]
name = "zero"
dir = "run"
iterations = 2
[agent]
module = "agent.py"
{extra}
[data]
train = "train.jsonl"
tasks_per_iteration = 2
group_size = 4
[rollout]
concurrency = 8
timeout = {300 if serve else 30}
{serve}""")
    return tmp_path / "lightning.toml"


# The vLLM lane (`pytest -m vllm`): the same agents against vLLM's CPU build: the Responses API (the Agents SDK) and
# LiteLLM's low-level path, each a run of its own server (30-70 s to start on 2 cores); the plain openai client's
# runs are tests/test_vllm_runs.py's.
VLLM = '[serve]\nbackend = "vllm"\nsleep_level = 0\nstartup_timeout = 900.0\nmax_model_len = 512\n'


@pytest.fixture()
def openai_elsewhere(monkeypatch):
    """The agent's own environment points at another OpenAI-compatible service (nothing listens on port 9)."""
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-users-own-key")
    monkeypatch.delenv("OPENAI_AGENTS_DISABLE_TRACING", raising=False)
    monkeypatch.delenv("OPENAI_API_BASE", raising=False)
    return _openai_env()


def _openai_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("OPENAI")}


@pytest.mark.parametrize("source, backend", [
    *((source, "cpu") for source in (PLAIN, LANGCHAIN, AGENTS_SDK, LITELLM, DSPY, RAW_HTTPX, REQUESTS)),
    *(pytest.param(source, "vllm", marks=pytest.mark.vllm) for source in (AGENTS_SDK, LITELLM)),
], ids=["openai-client", "langchain", "agents-sdk", "litellm", "dspy", "httpx", "requests",
        "vllm-agents-sdk", "vllm-litellm"])
def test_an_unchanged_agent_trains(tmp_path, openai_elsewhere, source, backend, caplog, monkeypatch):
    """The Agents SDK's `Agent` given only a model name calls the Responses API (`/v1/responses`)."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list otherwise
    with caplog.at_level("INFO", logger="lightning_sdk"):
        result = ls.run(project(tmp_path, source, serve=VLLM if backend == "vllm" else ""))
    assert [row["iteration"] for row in result.history] == [1, 2]
    assert all(row["rollout/failed"] == 0 and row["rollout/transitions"] == 8 for row in result.history)
    store = Store(tmp_path / "run/store.sqlite")
    calls = [s for r in store.rollouts(phase="train") for s in store.spans(r.rollout_id) if s.source == "gateway"]
    assert len(calls) == 16 and all(s.attributes["lightning.llm.completion_token_ids"] for s in calls)
    assert {s.attributes["gen_ai.request.model"] for s in calls} == {"gpt-4o-mini"}  # what the agent asked for
    assert {s.attributes["lightning.llm.api"] for s in calls} == {
        "responses" if source is AGENTS_SDK else "chat.completions"}
    assert {s.attributes["gen_ai.response.model"] for s in calls} == {"builtin:tiny-arith", "zero-iter1"}  # served
    assert any("the agent asked for model 'gpt-4o-mini'" in r.getMessage() for r in caplog.records)
    assert _openai_env() == openai_elsewhere  # the agent's environment is its own again after the run


def test_redirect_off_leaves_the_agent_s_environment_alone(tmp_path, openai_elsewhere):
    with pytest.raises(RunError, match=r"8 of 8 rollouts failed.*APIConnectionError"):
        ls.run(project(tmp_path, PLAIN, redirect_openai=False))
    assert os.environ["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1"  # it called its own service (not there)
    assert _openai_env() == openai_elsewhere
