"""The cookbook's agents, in their real frameworks, trained unchanged: a short `lightning run` of each
(one iteration, few tasks, small groups) as a subprocess, then what its store shows. The first three also run with
serve.backend = "vllm" in the vLLM lane (`pytest -m vllm`, .ci/run: vLLM's CPU build, sleep_level 0)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sdk import config, transitions
from lightning_sdk.constraint import Constraint
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import COMPLETION_TOKENS, CONSTRAINT, POLICY
from safetensors.torch import load_file

from .conftest import in_rollout

ROOT = Path(__file__).resolve().parents[1]


def lightning(*args, cwd, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", *args], cwd=cwd, env=env, text=True,
                         capture_output=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BACKENDS = ["cpu", pytest.param("vllm", marks=pytest.mark.vllm)]
# vLLM's CPU build, as a GPU user's run would start it but for sleep mode (none off CUDA); a generous start: 30-70 s
# quiet on 2 cores, minutes when the machine is busy.
VLLM_SERVE = '[serve]\nbackend = "vllm"\nsleep_level = 0\nstartup_timeout = 900.0\nmax_model_len = 2048\n'


def small_run(example: str, tmp: Path, *, tasks: int = 3, group: int = 3, eval_tasks: int = 3,
              backend: str = "cpu") -> Path:
    """The example's own lightning.toml, shrunk: a few tasks, one iteration of small groups."""
    src = ROOT / "cookbook" / example
    text = (src / "lightning.toml").read_text()
    for line in (src / "data/train.jsonl").read_text().splitlines()[:tasks]:
        (tmp / "train.jsonl").open("a").write(line + "\n")
    for line in (src / "data/test.jsonl").read_text().splitlines()[:eval_tasks]:
        (tmp / "test.jsonl").open("a").write(line + "\n")
    text = text.replace('module = "agent.py"', f'module = "{src / "agent.py"}"')
    text = text.replace('name = "tiny:teacher.py"', f'name = "tiny:{src / "teacher.py"}"')
    text = text.replace('train = "data/train.jsonl"', 'train = "train.jsonl"')
    text = text.replace('eval = "data/test.jsonl"', 'eval = "test.jsonl"')
    text = re.sub(r"iterations = \d+", "iterations = 1", text)
    text = re.sub(r"tasks_per_iteration = \d+", f"tasks_per_iteration = {tasks}", text)
    text = re.sub(r"group_size = \d+", f"group_size = {group}", text)
    if backend == "vllm":
        text = text.replace('[serve]\nbackend = "cpu"\n', VLLM_SERVE)
        assert VLLM_SERVE in text
    (tmp / "lightning.toml").write_text(text)
    return tmp / "lightning.toml"


def transitions_of(cfg_path: Path) -> tuple[Store, list, list]:
    cfg = config.load(cfg_path)
    store = Store(cfg.run.dir / "store.sqlite")
    rollouts = store.rollouts(phase="train")
    out = [t for r in rollouts if r.status == "succeeded"
           for t in transitions.to_transitions(r, store.spans(r.rollout_id), components=cfg.rollout.components,
                                           error_reward=cfg.rollout.error_reward)]
    return store, rollouts, out


def trained_example(example: str, tmp: Path, backend: str = "cpu", *, tasks: int = 3, group: int = 3,
                    unparsed: int = 0) -> tuple[Path, Store, list, list]:
    """A one-iteration run of the example with its untrained and trained evals; all `tasks` x `group` training
    rollouts succeed (but at most `unparsed`, each failed by DSPy's AdapterParseError on a sample neither of its
    adapters can read), every recorded call has exact ids, and the trained eval is served by the hot-loaded
    adapter."""
    toml = small_run(example, tmp, tasks=tasks, group=group, eval_tasks=2, backend=backend)
    out = lightning("run", "-c", str(toml), cwd=tmp, timeout=300 if backend == "cpu" else 1500)
    assert "eval (untrained" in out and "eval (trained" in out
    store, rollouts, trained = transitions_of(toml)
    failed = [r for r in rollouts if r.status != "succeeded"]
    assert len(rollouts) == tasks * group and len(failed) <= unparsed, [r.error for r in failed]
    assert all(r.status == "failed" and "AdapterParseError" in (r.error or "") for r in failed)
    assert all(t.logprobs is not None and all(map(math.isfinite, t.logprobs)) for t in trained)
    evals = [s for r in store.rollouts(phase="eval") for s in store.spans(r.rollout_id) if transitions.is_llm_call(s)]
    assert {s.attributes[POLICY] for s in evals} >= {f"{config.load(toml).run.name}-iter1"}
    saved = next(config.load(toml).run.dir.glob("checkpoints/*/trainer/adapter/adapter_model.safetensors"))
    adapter = load_file(saved)
    assert all(bool(v.isfinite().all()) for v in adapter.values())
    return toml, store, rollouts, trained


@pytest.mark.parametrize("backend", BACKENDS)
def test_calc_autogen_trains_and_evals(tmp_path, backend):
    toml, store, rollouts, trained = trained_example("calc", tmp_path, backend)
    names = {s.name for r in rollouts for s in store.spans(r.rollout_id)}
    assert "invoke_agent calc" in names  # AutoGen's own spans reach the store beside the LLM calls
    assert trained and all(t.completion_ids for t in trained)
    if backend == "vllm":  # `lightning eval` is the same command whatever the backend: the cpu lane tests it
        return
    # `lightning eval` scores the base and the trained adapter on the held-out tasks.
    base = lightning("eval", "-c", str(toml), "--limit", "1", cwd=tmp_path)
    trained = lightning("eval", "-c", str(toml), "--trained", cwd=tmp_path)
    assert re.search(r"held-out score \d\.\d{3} over 1 tasks \(mean reward ± standard error\) of the base model ",
                     base)
    assert re.search(r"held-out score \d\.\d{3} ± \d\.\d{3} over 2 tasks .* of iteration 1 \(checkpoint .*iter-00001",
                     trained)
    # The pretrained model calls the calculator in about half of its answers (teacher.py): across the run's 13
    # rollouts (9 training, 2 + 2 in its evals) AutoGen ran the calls, each followed by the reflection LLM call.
    everything = store.rollouts(phase="train") + store.rollouts(phase="eval")
    assert len(everything) == 9 + 2 + 2
    tools = 0
    for r in everything:
        kinds = ["llm" if transitions.is_llm_call(s) else "tool" for s in store.spans(r.rollout_id)
                 if transitions.is_llm_call(s) or s.name == "execute_tool calculator"]
        assert kinds == ["llm"] or (kinds[0] == kinds[-1] == "llm" and set(kinds[1:-1]) == {"tool"}), kinds
        tools += kinds.count("tool")
    assert tools > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sql_langgraph_trains_only_writer_and_rewriter(tmp_path, backend):
    _, store, rollouts, trained = trained_example("sql", tmp_path, backend)
    assert all(r.reward in (0.0, 1.0) for r in rollouts)  # execution match
    # Each rollout is the LangGraph flow: writer, checker, and the rewriter only when the checker objected.
    for r in rollouts + store.rollouts(phase="eval"):
        nodes = [s.component for s in store.spans(r.rollout_id) if transitions.is_llm_call(s)]
        assert nodes in (["writer", "checker"], ["writer", "checker", "rewriter"]), nodes
    calls = [s for r in rollouts for s in store.spans(r.rollout_id) if transitions.is_llm_call(s)]
    assert {"writer", "checker"} <= {s.component for s in calls}  # every LangGraph node's call is traced
    assert {t.component for t in trained} <= {"writer", "rewriter"} and trained
    ids = {t.span_id for t in trained}
    assert all(s.span_id not in ids for s in calls if s.component == "checker")
    assert ids == {s.span_id for s in calls if s.component in ("writer", "rewriter") and not s.is_error}


@pytest.mark.parametrize("backend", BACKENDS)
def test_rag_agents_sdk_trains(tmp_path, backend):
    _, store, rollouts, trained = trained_example("rag", tmp_path, backend)
    assert all(0.0 <= r.reward <= 1.0 for r in rollouts)  # answer F1
    assert trained and all(t.prompt_ids and t.completion_ids for t in trained)
    # The pretrained model searches in most of its answers (teacher.py): the SDK ran the search tool on the
    # model's query, and the next LLM call of the rollout has exactly what BM25 returned for it in its prompt.
    rag = load_module(ROOT / "cookbook/rag/agent.py")
    calls = [[s for s in store.spans(r.rollout_id) if transitions.is_llm_call(s)]
             for r in rollouts + store.rollouts(phase="eval")]
    assert all(1 <= len(c) <= 4 for c in calls)  # agent.py's max_turns
    searched = [json.loads(c[1].attributes["gen_ai.input.messages"]) for c in calls if len(c) > 1]
    assert searched
    for messages in searched:
        call, result = messages[2]["parts"][0], messages[3]["parts"][0]
        assert call["name"] == "search" and result["id"] == call["id"]
        assert result["response"] == rag.search_passages(call["arguments"]["query"])


def test_extract_openai_parse_trains_under_its_schema(tmp_path):
    _, store, rollouts, trained = trained_example("extract", tmp_path)
    assert all(r.reward in (0.0, 1 / 3, 2 / 3, 1.0) for r in rollouts)  # the share of fields right
    # every call was sampled under Person's schema, recorded with it, and trained under it
    calls = [s for r in rollouts + store.rollouts(phase="eval") for s in store.spans(r.rollout_id)
             if transitions.is_llm_call(s)]
    assert calls and all(json.loads(s.attributes["lightning.llm.constraint"])["spec"]["title"] == "Person"
                         for s in calls)
    assert trained and all(t.constraint for t in trained)
    assert all(set(r.output) == {"name", "age", "city"} for r in rollouts)


def test_dspy_react_trains_through_its_chat_adapter(tmp_path):
    """dspy.ReAct with DSPy's default adapters: the tiny model writes the ChatAdapter's fields, so DSPy's own parser
    reads its calls and the run trains. A sample the ChatAdapter cannot parse is asked again through DSPy's
    JSONAdapter under `response_format` (which samples do differs by CPU): that call is recorded with its schema and
    trains under it. A sample neither adapter reads fails its rollout (seen on CI: 1 of 9; at most 4 of 16 here), the
    run goes on."""
    toml, store, rollouts, trained = trained_example("react_dspy", tmp_path, tasks=2, group=8, unparsed=4)
    assert trained and all(t.completion_ids for t in trained)
    # The untrained model calls `add` and copies its result about half of the time (teacher.py), so some group's
    # rewards differ, its advantages are not 0 and the update moves the adapter (LoRA's B starts at 0; beta is 0).
    # At p = 1/2 a group of 8 is uniform with probability 2 * 2^-8, both groups with 2^-14 (6e-5); at p = 0.3,
    # 3e-3 (a parse failure leaves its group a rollout smaller).
    groups = {}
    for r in rollouts:
        if r.status == "succeeded":
            groups.setdefault(r.group_id, []).append(r.reward)
    assert any(len(set(g)) > 1 for g in groups.values()), groups
    adapter = load_file(next(config.load(toml).run.dir.glob("checkpoints/*/trainer/adapter/adapter_model.safetensors")))
    assert any(bool(v.abs().max() > 0) for n, v in adapter.items() if "lora_B" in n)
    everything = [r for r in rollouts + store.rollouts(phase="eval") if r.status == "succeeded"]
    assert all(r.reward in (0.0, 1.0) for r in everything if r.phase == "train")
    steps, fallback = [], set()
    for r in everything:
        calls = [s for s in store.spans(r.rollout_id) if transitions.is_llm_call(s)]
        assert calls
        constrained = {s.span_id for s in calls if CONSTRAINT in s.attributes}
        assert all(Constraint.from_json(s.attributes[CONSTRAINT]).kind in ("json_schema", "json_object")
                   for s in calls if s.span_id in constrained)
        if constrained:
            fallback |= constrained
            continue
        texts = ["".join(s.attributes[COMPLETION_TOKENS]) for s in calls]
        # ReAct's steps, each `next_tool_name` as the model wrote it, then the extract step's `answer`: the int
        # the agent returned is the one DSPy's ChatAdapter parsed out of the last call's text.
        steps.append([re.search(r"\[\[ ## next_tool_name ## \]\]\n(\w+)", t).group(1) for t in texts[:-1]])
        assert re.search(r"\[\[ ## answer ## \]\]\n(\d+)", texts[-1]).group(1) == str(r.output)
    assert len(steps) >= 3 * len(everything) // 4, f"{len(everything) - len(steps)} rollouts fell back to JSON"
    assert all(s[-1] == "finish" or len(s) == 3 for s in steps)  # agent.py's max_iters
    assert all(t.constraint for t in trained if t.span_id in fallback)
    print("react steps:", steps, "rewards:", [r.reward for r in rollouts], "json fallbacks:", len(fallback),
          "unparsed:", sum(r.status == "failed" for r in rollouts))


def test_failed_autogen_tool_call_is_a_negative_intermediate_reward(gw, store):
    """A calculator call with a bad expression, run by AutoGen's own tool machinery after a real LLM call: its
    ERROR span reaches the store by itself and costs the call before it `error_reward`."""
    import asyncio

    import openai
    from autogen_core import CancellationToken
    from autogen_core.tools import FunctionTool

    from lightning_sdk import tracing

    calc = load_module(ROOT / "cookbook/calc/agent.py")
    tool = FunctionTool(calc.calculator, description="calculator")
    client = openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key, max_retries=0)
    store.start_rollout("r1", task_id="t", group_id="0:0", iteration=0, phase="train")
    with in_rollout(gw, "r1"):
        client.chat.completions.create(model="gpt-4o-mini", max_tokens=4,
                                       messages=[{"role": "user", "content": "What is 2 + 3?"}])
        assert asyncio.run(tool.run_json({"expression": "2+3"}, CancellationToken())) == "5"
        with pytest.raises(ValueError, match="cannot evaluate"):
            asyncio.run(tool.run_json({"expression": "2*"}, CancellationToken()))
    store.finish_rollout("r1", status="succeeded", output="5", reward=1.0)
    assert gw.capture.flush()
    tracing.flush()
    spans = store.spans("r1")
    tools = [s for s in spans if s.name == "execute_tool calculator"]
    assert [s.status for s in tools] == ["UNSET", "ERROR"] and "cannot evaluate" in tools[1].status_message
    [t] = transitions.to_transitions(store.rollout("r1"), spans, error_reward=-0.5)
    assert t.reward == pytest.approx(1.0 - 0.5)


def test_eval_without_a_checkpoint_or_eval_data_is_a_clear_error(tmp_path):
    toml = small_run("calc", tmp_path)
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "eval", "-c", str(toml), "--trained"],
                         cwd=tmp_path, env=env, text=True, capture_output=True, timeout=60)
    assert out.returncode == 2 and "no checkpoint in" in out.stdout and "lightning run" in out.stdout
    toml.write_text(toml.read_text().replace('eval = "test.jsonl"\n', ""))
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.cli", "eval", "-c", str(toml)],
                         cwd=tmp_path, env=env, text=True, capture_output=True, timeout=60)
    assert out.returncode == 2 and "data.eval is not set" in out.stdout


def test_dspy_react_at_its_lower_bound_rolls_out_with_exact_ids(tmp_path):
    """The react_dspy agent, unchanged, under the lowest DSPy pyproject allows (CI: .venv-dspy-lowest, named by
    LIGHTNING_TEST_DSPY_LOWEST) as a `lightning worker`: a ReAct rollout through the gateway, each LLM call
    recorded with the server's token ids (each a transition), and the answer DSPy's ChatAdapter parsed is the one
    the model wrote. No training: what may differ between DSPy versions is the agent side, and this is all of it."""
    from lightning_sdk import models
    from lightning_sdk.servers.cpu import CPUServer

    from .remote_harness import KEY, Api, job

    python = os.environ.get("LIGHTNING_TEST_DSPY_LOWEST")
    if not python:
        pytest.skip("LIGHTNING_TEST_DSPY_LOWEST names no Python with DSPy at its lower bound")
    version = subprocess.run([python, "-c", "import dspy; print(dspy.__version__)"], capture_output=True, text=True,
                             check=True).stdout.strip()
    low = re.search(r'"dspy>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert version.startswith(low), (version, low)
    src = ROOT / "cookbook/react_dspy"
    tasks = [json.loads(line) for line in (src / "data/test.jsonl").read_text().splitlines()[:1]]
    with CPUServer(models.resolve(f"tiny:{src / 'teacher.py'}"), served_model_name="policy", threads=1,
                   dtype="float32", log_path=tmp_path / "server.log") as server:
        api = Api(server, Store(tmp_path / "server.sqlite"), timeout=120)
        api.queue([job(k, t) for k, t in enumerate(tasks)])
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OPENAI_BASE_URL")}
        env.update(LIGHTNING_TOKEN=KEY, HOME=str(tmp_path), LITELLM_LOCAL_MODEL_COST_MAP="True")
        worker = subprocess.Popen([python, "-m", "lightning_sdk.cli", "worker", str(src / "agent.py"), "--server",
                                   api.url, "--concurrency", "1"], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            results = api.results(1, timeout=150)
        finally:
            worker.kill()
            said, _ = worker.communicate(timeout=30)
            api.stop()
    assert all(r.status == "succeeded" for r in results), [r.error for r in results] + [said[-3000:]]
    for r in results:
        calls = sorted((s for s in api.store.spans(r.job.rollout_id) if transitions.is_llm_call(s)),
                       key=lambda s: s.start_ns)
        assert calls and all(s.attributes["lightning.llm.completion_token_ids"] for s in calls)
        assert all("lightning.llm.constraint" not in s.attributes for s in calls)  # the ChatAdapter, no fallback
        texts = ["".join(s.attributes[COMPLETION_TOKENS]) for s in calls]
        assert re.search(r"\[\[ ## answer ## \]\]\n(\d+)", texts[-1]).group(1) == str(r.output)
        assert r.reward == float(r.output == r.job.task["answer"])
        trained = transitions.to_transitions(api.store.rollout(r.job.rollout_id), api.store.spans(r.job.rollout_id))
        assert len(trained) == len(calls) and all(t.prompt_ids and t.completion_ids for t in trained)
