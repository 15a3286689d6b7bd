"""Real `lightning run`s with serve.backend = "vllm" (the vLLM lane, `pytest -m vllm`: vLLM's CPU build, sleep level
0): pipelined training (train.max_staleness = 1), and two policies (multi-LoRA) trained with QLoRA (each on the nf4
base; vLLM serves it unquantized) in one run, as a vLLM start is most of a run's time. Two iterations of small
batches each; each asserts what the CPU lane asserts of its runs: every call recorded with the server's token ids
and finite log-probs, no failed rollout, both iterations trained into finite adapters, and the second iteration
served by the adapter hot-loaded after the first."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

import lightning_sdk as ls
from lightning_sdk.store import Store
from lightning_sdk.tracing import COMPLETION_IDS, COMPLETION_LOGPROBS
from lightning_sdk.tracing.records import COMPONENT, POLICY

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent
ROOT = HERE.parent
POLICIES = '''
[policies.writer]
components = ["writer"]
[policies.rewriter]
components = ["rewriter"]
lora_r = 4
'''
SCENARIOS = {
    "pipelined": ("[train]\nmax_staleness = 1\n", HERE / "unchanged_agent.py"),
    "qlora-policies": (POLICIES + "[model]\nquantization = \"4bit\"\n", HERE / "policies_agent.py"),
}


def write_run(d: Path, extra: str, module: Path) -> Path:
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9][:3]) + "\n")
    model = "" if "[model]" in extra else "[model]\n"
    (d / "lightning.toml").write_text(f'''
[run]
name = "v"
dir = "run"
iterations = 2
[agent]
module = "{module}"
[data]
train = "train.jsonl"
tasks_per_iteration = 3
group_size = 4
[serve]
backend = "vllm"
sleep_level = 0
startup_timeout = 900.0
max_model_len = 512
[rollout]
concurrency = 12
timeout = 300
{extra}
{model}''')
    return d / "lightning.toml"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_vllm_run_trains_on_exact_ids(tmp_path, scenario, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toml = write_run(tmp_path, *SCENARIOS[scenario])
    state = ls.run(toml)
    assert [row["iteration"] for row in state.history] == [1, 2]
    assert all(row["rollout/failed"] == 0 and row["rollout/transitions"] > 0 for row in state.history)
    gaps = [v for row in state.history for k, v in row.items() if k.endswith("logprob_gap")]  # per policy too
    assert len(gaps) >= 2 and all(math.isfinite(g) for g in gaps)
    store = Store(tmp_path / "run/store.sqlite")
    rollouts = store.rollouts(phase="train")
    assert {r.status for r in rollouts} == {"succeeded"}
    calls = [s for r in rollouts for s in store.spans(r.rollout_id) if s.source == "gateway"]
    assert calls and all(s.attributes[COMPLETION_IDS] for s in calls)
    assert all(len(s.attributes[COMPLETION_LOGPROBS]) == len(s.attributes[COMPLETION_IDS]) and
               all(math.isfinite(x) for x in s.attributes[COMPLETION_LOGPROBS]) for s in calls)
    second = {s.attributes[POLICY] for r in rollouts if r.iteration == 2 for s in store.spans(r.rollout_id)
              if s.source == "gateway" and s.attributes.get(COMPONENT) != "judge"}
    if scenario == "qlora-policies":
        assert second == {"v-writer-iter1", "v-rewriter-iter1"}, second
    else:  # k = 1: the second collection may start before the first update is served
        assert second <= {"builtin:tiny-arith", "v-iter1"}
    adapters = list((tmp_path / "run/checkpoints").glob("iter-00002/trainer/**/adapter_model.safetensors"))
    assert adapters and all(bool(v.isfinite().all()) for a in adapters for v in load_file(a).values())
    if scenario == "qlora-policies":
        gaps = [{k: round(v, 4) for k, v in r.items() if k.endswith("logprob_gap")} for r in state.history]
        print(f"QLoRA on vLLM: logprob gaps {gaps}")
