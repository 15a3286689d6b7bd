"""vLLM's log-probs under a grammar are the masked, renormalised ones the trainer computes: its CPU build samples
`response_format` json_schema replies (processed_logprobs, float32), and the trainer's replayed-grammar scoring
matches them where unmasked scoring does not (benchmarks/vllm_constrained_gap.py). Tool calls, forced or not, with
and without `"strict": true`, are sampled under the structural tag the trainer replays (vLLM started with
`--tool-strict-level parameter`; benchmarks/vllm_tool_call_gap.py), and a run of forced calls trains on them with
none left out. The vLLM lane only."""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import lightning_sdk as ls  # noqa: E402
from lightning_sdk.files import load_py_file  # noqa: E402
from lightning_sdk.store import Store  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent


def test_vllm_log_probs_under_a_grammar_are_the_masked_ones():
    gap = load_py_file(ROOT / "benchmarks/vllm_constrained_gap.py", "vllm_constrained_gap")
    m = gap.measure(8)
    assert m["rejected"] == 0  # vLLM's compact JSON grammar is the one the trainer replays
    assert m["masked_max"] <= 1e-5 and m["unmasked_mean"] > 1.0, m


def test_the_structural_tag_is_vllm_s_own():
    """The tag grammar.py builds for each tool_choice and parallel_tool_calls form equals the one vLLM's hermes
    parser builds at the strict level vLLM is started with, tools with `strict`, without it and without
    parameters alike."""
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionNamedToolChoiceParam,
                                                                   ChatCompletionToolsParam)
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    from xgrammar import StructuralTag

    from lightning_sdk.constraint import from_request
    from lightning_sdk.grammar import tool_calls_tag

    tools = [{"type": "function", "function": {"name": "calc", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
             {"type": "function", "function": {"name": "look", "strict": True, "parameters": {
                 "type": "object", "properties": {"q": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "bare"}}]
    forms = 0
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "calc"}},
                   {"type": "function", "function": {"name": "bare"}}):
        for parallel in (None, False):
            body = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
            ours = StructuralTag.model_validate(tool_calls_tag(from_request(body).spec)).model_dump()
            named = ChatCompletionNamedToolChoiceParam.model_validate(choice) if isinstance(choice, dict) else None
            theirs = get_model_structural_tag("hermes", [ChatCompletionToolsParam.model_validate(t) for t in tools],
                                              named or choice or "auto", False,
                                              strict_level=ToolStrictLevel.PARAMETER)
            if parallel is False:
                limit_to_single_tool_call(theirs)
            assert ours == theirs.model_dump(), (choice, parallel)
            forms += 1
    assert forms == 10


def test_tool_calls_are_scored_as_vllm_sampled_them():
    """Every reply accepted by the replayed grammar, and the trainer's masked log-probs vLLM's, for each of
    required / named / auto, with and without `strict`, and auto with a response format."""
    gap = load_py_file(ROOT / "benchmarks/vllm_tool_call_gap.py", "vllm_tool_call_gap")
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
    cases = {**gap.CASES, "auto + response_format": {**gap.CASES["auto no strict"], "response_format": schema}}
    m = gap.measure(6, cases)
    assert all(r["rejected"] == 0 and r["replayed"] for r in m.values()), m
    assert all(r["mean"] <= 1e-5 for r in m.values()), m
    assert all(r["calls"] == r["replies"] for name, r in m.items() if name.startswith(("required", "named"))), m


def test_forced_tool_calls_with_and_without_strict_train_on_vllm_s_log_probs(tmp_path, monkeypatch):
    """calc's model, 4 tasks x 4 samples, 2 iterations: one policy's calls offer the tool with `"strict": true`, the
    other's without; both are constrained, none left out for a mismatch, both policies' gaps under 1e-4."""
    monkeypatch.chdir(tmp_path)
    rows = (ROOT / "cookbook/calc/data/train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(rows[:4]) + "\n")
    (tmp_path / "lightning.toml").write_text(f'''
[run]
name = "forced"
dir = "run"
iterations = 2
[agent]
module = "{HERE / 'forced_tools_agent.py'}"
[data]
train = "train.jsonl"
tasks_per_iteration = 4
group_size = 4
[model]
name = "tiny:{ROOT / 'cookbook/calc/teacher.py'}"
dtype = "float32"
[serve]
backend = "vllm"
sleep_level = 0
startup_timeout = 900.0
max_model_len = 1024
[rollout]
concurrency = 16
timeout = 300
[policies.strict]
components = ["strict"]
[policies.loose]
components = ["loose"]
''')
    state = ls.run(tmp_path / "lightning.toml")
    assert [row["iteration"] for row in state.history] == [1, 2]
    assert all(row["rollout/failed"] == 0 and row["rollout/transitions"] > 0 for row in state.history)
    gaps = {k: v for row in state.history for k, v in row.items() if k.endswith("logprob_gap")}
    print("forced tool calls on vLLM: logprob gaps", [{k: v for k, v in row.items() if k.endswith("logprob_gap")}
                                                      for row in state.history])
    assert {"train/strict/logprob_gap", "train/loose/logprob_gap"} <= set(gaps), gaps
    assert all(math.isfinite(v) and v <= 1e-4 for v in gaps.values()), gaps
    store = Store(tmp_path / "run/store.sqlite")
    calls = [s for r in store.rollouts(phase="train") for s in store.spans(r.rollout_id) if s.source == "gateway"]
    assert len(calls) == 2 * 4 * 4 * 4
    assert all(json.loads(s.attributes["lightning.llm.constraint"])["kind"] == "tool_calls" for s in calls)
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    # every call replayed under its grammar and trained on: none left out for a mismatch
    assert sum(m.get("train/num_constrained", 0) for m in metrics) == len(calls), metrics
    assert sum(m.get("train/constraint_mismatch", 0) for m in metrics) == 0, metrics
