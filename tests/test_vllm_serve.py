"""`lightning serve` with [learn] on vLLM (the vLLM lane, `pytest -m vllm`: vLLM's CPU build, sleep level 0), the
path a production user runs: calls served by vLLM are recorded at the gateway with vLLM's token ids and log-probs,
the app's rewards make an update from them, the real gate (data.eval's tasks through the agent, on the serving vLLM
itself: each side a LoRA loaded beside the serving one, no second vLLM) promotes it, and the next call is served by
the adapter hot-loaded into vLLM; a worse candidate is rejected and never stays loaded. The CPU lane runs the same
machinery on the built-in server (tests/test_serve_learn.py). vLLM's CPU build has no sleep mode, so the update's
GPU turn (production/gpu_turn.py: vLLM asleep, calls held at the gateway) is not run here: the door that holds the
calls is tested on the CPU lane (tests/test_serve_gpu_turn.py), vLLM's sleep itself only on a CUDA GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import openai
import pytest

from lightning_sdk import config
from lightning_sdk.production import deployment, gate
from lightning_sdk.production.episodes import episode_id
from lightning_sdk.tracing import COMPLETION_IDS, COMPLETION_LOGPROBS
from lightning_sdk.tracing.records import GATEWAY, POLICY

from .test_serve_learn import lora_b, project, reward_all, served_models, traffic

pytestmark = pytest.mark.vllm

VLLM = '[serve]\nbackend = "vllm"\nsleep_level = 0\nstartup_timeout = 900.0\nmax_model_len = 512\n'


def test_served_calls_on_vllm_train_an_update_that_the_real_gate_decides_on_the_same_vllm(tmp_path):
    project(tmp_path)  # the CPU lane's [learn] project: 4 rewarded episodes make an update; the agent's reward is 1
    # where the eval call was served by version 1 (app-iter1), so v1 beats the base model and v2 is worse than v1
    toml = tmp_path / "lightning.toml"
    toml.write_text(toml.read_text().replace("[serve]\nmax_batch_size = 4\n", VLLM))
    cfg = config.load(toml)
    dep = deployment.start(cfg, tmp_path / "serve", host="127.0.0.1", port=0, api_key=None, retention_s=3600)
    loads, load = [], dep.server.load_adapter

    def seen(name, path, **kw):  # the real load into the serving vLLM, with the names it was given kept
        loads.append(name)
        return load(name, path, **kw)

    dep.server.load_adapter = seen
    try:
        episodes = traffic(dep, 4)
        dep.gateway.capture.flush()
        calls = [s for t in episodes for s in dep.store.spans(episode_id(t)) if s.source == GATEWAY]
        assert len(calls) == 4
        for s in calls:  # vLLM's own ids and log-probs, one per sampled token
            ids, lps = s.attributes[COMPLETION_IDS], s.attributes[COMPLETION_LOGPROBS]
            assert ids and len(lps) == len(ids) and all(math.isfinite(x) and x <= 0 for x in lps)
        reward_all(dep, episodes)  # rewards 0, 1, 0, 1 on one prompt: every call has an advantage
        dep.schedule.run_once()
        (u,) = dep.schedule.learner.updates()
        ev = json.loads(u["evidence"])
        assert (u["version"], ev["rewards"], ev["calls"], ev["stale"]) == (1, 4, 4, 0)
        assert ev["metrics"]["num_transitions"] == 4 and ev["metrics"]["grad_norm"] > 0
        # the trainer's log-probs of vLLM's tokens against vLLM's own, before the update (same weights)
        assert math.isfinite(ev["metrics"]["logprob_gap"]) and ev["metrics"]["logprob_gap"] < 1e-3
        assert lora_b(Path(u["checkpoint"])) > 0
        (decision,) = gate.decisions(dep.store.path)
        # the real gate: the agent over data.eval's 3 tasks, v1 (served as app-iter1) against the base model
        assert (decision.candidate, decision.promoted) == ("app-serve-v1", True)
        assert decision.candidate_scores == [1.0] * 3 and decision.serving_scores == [0.0] * 3
        assert dep.gateway.policy == "app-serve-v1"
        # scored on the serving vLLM (the candidate loaded into it, unloaded after), then promoted into it
        assert loads == ["app-iter1", "app-serve-v1"]
        assert served_models(dep) == ["builtin:tiny-arith", "app-serve-v1"]
        client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key=dep.api_key, max_retries=0)
        trace = "ab" * 16
        reply = client.chat.completions.create(model="gpt-4o-mini", max_tokens=2,
                                               messages=[{"role": "user", "content": "What is 1 + 1?"}],
                                               extra_headers={"traceparent": f"00-{trace}-{'cd' * 8}-01"})
        assert reply.model == "app-serve-v1"  # vLLM served it with the hot-loaded adapter
        dep.gateway.capture.flush()
        (last,) = [s for s in dep.store.spans(episode_id(trace)) if s.source == GATEWAY]
        assert last.attributes[POLICY] == "app-serve-v1" and last.attributes[COMPLETION_IDS]
        more = traffic(dep, 4, prompt="What is 3 + 3?")
        dep.gateway.capture.flush()
        reward_all(dep, more, salt="m")
        dep.schedule.run_once()  # v2 from v1: the gate scores it 0,0,0 against v1's 1,1,1 on the same vLLM
        _, rejected = gate.decisions(dep.store.path)
        assert (rejected.candidate, rejected.serving, rejected.promoted) == ("app-serve-v2", "app-serve-v1", False)
        assert rejected.candidate_scores == [0.0] * 3 and rejected.serving_scores == [1.0] * 3
        assert dep.gateway.policy == "app-serve-v1" and loads[2:] == ["app-iter2", "app-iter1"]
        assert served_models(dep) == ["builtin:tiny-arith", "app-serve-v1"]  # the rejected one never stays
        print(f"vLLM serve: logprob_gap {ev['metrics']['logprob_gap']:.2e}, grad_norm {ev['metrics']['grad_norm']:.3g}")
    finally:
        dep.close()
