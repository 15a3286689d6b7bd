"""Agents that ask for structured output train with no change but the two decorators: openai `.parse` with a
pydantic model, LangChain `with_structured_output`, DSPy Predict and ReAct (default adapters: the ChatAdapter,
then its JSONAdapter fallback, which sends `response_format`; DSPy's on-disk cache left as its users leave it),
instructor's default mode (a forced tool call) and the Agents SDK with `output_type`. The built-in server samples
each constrained call under its grammar; the gateway records the constraint; the trainer replays it. A real short
run each (embedded runtime, tiny model, real server and trainer)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import lightning_sdk as ls
from lightning_sdk.dashboard.runs import RunReader
from lightning_sdk.errors import RunError
from lightning_sdk.store import Store

from .remote_harness import start_remote_run
from .test_zero_change import VLLM, openai_elsewhere, project  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]

ANSWER = '''
from pydantic import BaseModel, Field
import lightning_sdk as ls

class Answer(BaseModel):
    answer: int = Field(ge=0, le=99)

@ls.reward
def score(task, output):
    return float(str(output) == task["answer"])
'''
OPENAI_PARSE = ANSWER + '''
from openai import OpenAI

client = OpenAI()

@ls.rollout
def solve(task):
    out = client.chat.completions.parse(model="gpt-4o-mini", max_tokens=16, response_format=Answer,
                                        messages=[{"role": "user", "content": task["question"]}])
    return out.choices[0].message.parsed.answer
'''
LANGCHAIN = ANSWER + '''
from langchain_openai import ChatOpenAI

chat = ChatOpenAI(model="gpt-4o-mini", max_tokens=16, temperature=1.0).with_structured_output(Answer)

@ls.rollout
async def solve(task):
    return (await chat.ainvoke(task["question"])).answer
'''
AGENTS_SDK = ANSWER + '''
from agents import Agent, ModelSettings, Runner

solver = Agent(name="solver", model="gpt-4o-mini", output_type=Answer,
               model_settings=ModelSettings(temperature=1.0, max_tokens=16))

@ls.rollout
async def solve(task):
    return (await Runner.run(solver, task["question"])).final_output.answer
'''
INSTRUCTOR = ANSWER + '''
import instructor
from openai import OpenAI

client = instructor.from_openai(OpenAI())

@ls.rollout
def solve(task):
    return client.chat.completions.create(model="gpt-4o-mini", max_tokens=96, response_model=Answer, max_retries=0,
                                          messages=[{"role": "user", "content": task["question"]}]).answer
'''
DSPY_PREDICT = ANSWER + '''
import dspy

dspy.configure(lm=dspy.LM("openai/gpt-4o-mini", max_tokens=24, temperature=1.0, num_retries=0))
predict = dspy.Predict("question -> answer: int")

@ls.rollout
def solve(task):
    return predict(question=task["question"]).answer
'''
DSPY_REACT = ANSWER + '''
import dspy

dspy.configure(lm=dspy.LM("openai/gpt-4o-mini", max_tokens=48, temperature=1.0, num_retries=0))

def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b

react = dspy.ReAct("question -> answer: int", tools=[add], max_iters=2)

@ls.rollout
def solve(task):
    return react(question=task["question"]).answer
'''
AGENTS = {"openai-parse": OPENAI_PARSE, "langchain": LANGCHAIN, "agents-sdk": AGENTS_SDK, "instructor": INSTRUCTOR,
          "dspy-predict": DSPY_PREDICT}


@pytest.mark.parametrize("name", list(AGENTS))
def test_a_structured_output_agent_trains_exactly(tmp_path, openai_elsewhere, name, monkeypatch):  # noqa: F811
    if name == "instructor":
        # instructor (every release, 1.17 the latest) pins jiter<0.15, which openai 3.6x's jiter>=0.19 rules out:
        # it lives in an environment of its own (test_instructor_trains_from_a_worker_in_its_own_environment)
        pytest.importorskip("instructor")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("HOME", str(tmp_path))  # DSPy's cache directory: the user's, left as it is
    toml = project(tmp_path, AGENTS[name])
    # DSPy imports LiteLLM on its first call: ~10 s on a free 2-core machine, a minute under load
    toml.write_text(toml.read_text().replace("timeout = 30", "timeout = 180"))
    result = ls.run(toml)
    assert [row["iteration"] for row in result.history] == [1, 2]
    assert all(row["rollout/transitions"] > 0 for row in result.history)
    store = Store(tmp_path / "run/store.sqlite")
    calls = [s for r in store.rollouts(phase="train") for s in store.spans(r.rollout_id) if s.source == "gateway"]
    # every rollout drew its own samples: DSPy's reply cache (on by default) was off for the run
    assert all(any(s.source == "gateway" for s in store.spans(r.rollout_id)) for r in store.rollouts(phase="train"))
    constrained = [s for s in calls if "lightning.llm.constraint" in s.attributes]
    assert constrained and all(s.attributes["lightning.llm.completion_token_ids"] for s in calls)
    print(name, len(calls), "calls,", len(constrained), "constrained:",
          {json.loads(s.attributes["lightning.llm.constraint"])["kind"] for s in constrained},
          [(row["rollout/transitions"], row["rollout/failed"]) for row in result.history])
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("train/num_constrained", 0) for m in metrics) > 0
    assert all(m.get("train/constraint_mismatch", 0) == 0 for m in metrics)
    if name == "openai-parse":  # the dashboard's call view names the constraint and shows the schema
        reader = RunReader(tmp_path)
        rid = store.rollouts(phase="train")[0].rollout_id
        views = [v for v in reader.rollout("run", rid)["spans"] if v["kind"] == "llm"]
        assert views and all(v["constraint"]["label"] == "json_schema Answer" for v in views)
        assert all(v["constraint"]["param"] == "response_format.json_schema.schema" for v in views)
        assert '"maximum": 99' in views[0]["constraint"]["spec"]
    if name.startswith("dspy"):
        import dspy

        assert dspy.cache.enable_disk_cache  # the user's own cache is back after the run


def test_dspy_react_is_served_and_recorded_under_its_constraint(tmp_path, openai_elsewhere, monkeypatch):  # noqa: F811
    """ReAct's JSONAdapter asks for `json_object` (its signature holds an open `dict` of tool arguments, which DSPy
    does not send as a JSON schema): every call is served (no 400) and recorded with its constraint. The tiny
    model's objects lack ReAct's fields, so its rollouts fail in DSPy's parser and the run stops (the majority
    failed); a model that writes the fields trains as DSPy Predict does."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("HOME", str(tmp_path))
    toml = project(tmp_path, DSPY_REACT)
    toml.write_text(toml.read_text().replace("timeout = 30", "timeout = 180"))
    with pytest.raises(RunError, match="AdapterParseError"):
        ls.run(toml)
    store = Store(tmp_path / "run/store.sqlite")
    calls = [s for r in store.rollouts(phase="train") for s in store.spans(r.rollout_id) if s.source == "gateway"]
    assert calls and all(s.status == "OK" and s.attributes["lightning.llm.completion_token_ids"] for s in calls)
    kinds = {json.loads(s.attributes["lightning.llm.constraint"])["kind"] for s in calls
             if "lightning.llm.constraint" in s.attributes}
    assert kinds == {"json_object"}



@pytest.mark.parametrize("backend", ["builtin", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_instructor_trains_from_a_worker_in_its_own_environment(tmp_path, backend):
    """instructor's default mode (a forced tool call of a tool without `strict`) as a `lightning worker` in an
    environment of its own: this project without extras plus instructor, which brings its own openai (CI:
    .venv-instructor, named by LIGHTNING_TEST_INSTRUCTOR). The trainer runs here and never imports instructor. On
    vLLM too: its arguments are pinned to the tool's schema there as on the built-in server (an integer from 0 to
    99, never "Infinity"), and replayed as sampled, each as its record says that server applied it. The built-in
    server runs the default model, never taught a tool call: it samples compact arguments (free whitespace would
    fill them with newlines until max_tokens, 8 of 8 rollouts failed)."""
    python = os.environ.get("LIGHTNING_TEST_INSTRUCTOR")
    if not python:
        pytest.skip("LIGHTNING_TEST_INSTRUCTOR names no Python with instructor")
    d = tmp_path
    # vLLM's structural tag allows free whitespace in the arguments, which a model never taught a call fills with
    # newlines: there calc's model, which writes `<tool_call>` blocks as a real model does
    calc = f'[model]\nname = "tiny:{ROOT / "cookbook/calc/teacher.py"}"\ndtype = "float32"\n'
    toml = project(d, INSTRUCTOR, serve=VLLM + calc if backend == "vllm" else "")
    toml.write_text(toml.read_text().replace('dir = "run"', 'dir = "run"\nruntime = "remote"')
                    + "[remote]\nworker_timeout = 120\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("LIGHTNING_TOKEN", None)
    trainer, url = start_remote_run(d, env, timeout=900.0 if backend == "vllm" else 180.0)
    light = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    worker = subprocess.Popen([python, "-m", "lightning_sdk.cli", "worker", "agent.py", "--server", url,
                               "--token-file", str(d / "run/worker.token"), "--concurrency", "4"], cwd=d, env=light,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = trainer.communicate(timeout=900 if backend == "vllm" else 400)
        said, _ = worker.communicate(timeout=60)
    finally:
        trainer.kill()
        worker.kill()
    assert trainer.returncode == 0, out
    assert "run 'zero' is over: worker" in said, said
    metrics = [json.loads(line) for line in (d / "run/metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("phase") != "eval" and "rollout/transitions" in m]
    assert [m["iteration"] for m in train] == [1, 2] and all(m["rollout/transitions"] > 0 for m in train)
    print(backend, "failed rollouts, logprob gap:", [(m["rollout/failed"], m.get("train/logprob_gap")) for m in train])
    assert all(m["train/logprob_gap"] <= 1e-4 for m in train)  # scored as sampled: the same grammar replayed
    assert sum(m.get("train/num_constrained", 0) for m in metrics) > 0
    assert all(m.get("train/constraint_mismatch", 0) == 0 for m in metrics)
    store = Store(d / "run/store.sqlite")
    calls = [s for r in store.rollouts(phase="train") for s in store.spans(r.rollout_id) if s.source == "gateway"]
    assert calls and all(s.attributes["lightning.llm.completion_token_ids"] for s in calls)
    recorded = [json.loads(s.attributes["lightning.llm.constraint"]) for s in calls]
    assert {c["kind"] for c in recorded} == {"tool_calls"}
    # how the server applied it: hermes calls, compact arguments on the built-in server, free ones on vLLM
    assert all(c["server"] == {"tool_parser": "hermes", "reasoning_parser": None, "compact": backend == "builtin"}
               for c in recorded)
