"""What vLLM's log-probs mean under a grammar: its CPU build samples `response_format` json_schema replies, and the
trainer's way of scoring them (the grammar replayed over the sampled ids, logits masked before the softmax) is
compared with what vLLM reported, beside the unmasked scoring.

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 /tmp/lightning-vllm-cpu/bin/python benchmarks/vllm_constrained_gap.py

(the environment of benchmarks/vllm_cpu_check.sh). vLLM runs in float32 here, so the gap is the grammar's and the
kernels', not a precision's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning_sdk.servers.vllm as vllm_backend  # noqa: E402
from lightning_sdk import models  # noqa: E402
from lightning_sdk.constraint import from_request  # noqa: E402
from lightning_sdk.grammar import Grammars, additive_mask  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "sure": {"type": "boolean"}}, "required": ["answer", "sure"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": SCHEMA}}
TEMPERATURE, N = 1.0, 16


def measure(n: int = N) -> dict[str, float]:
    """`n` constrained replies from vLLM; the mean and max |trainer - vLLM| log-prob, masked and unmasked."""
    path = models.resolve("builtin:tiny-arith")
    tok, model = models.load_tokenizer(path), models.load_causal_lm(path, dtype="float32")
    grammars = Grammars(tok, int(model.get_output_embeddings().weight.shape[0]), models.eos_ids(model, tok))
    constraint = from_request({"response_format": FORMAT})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work, vllm_backend.VLLMServer(
            path, served_model_name="tiny", lora_r=8, max_model_len=512, dtype="float32", sleep_level=0,
            api_key="check", startup_timeout=600, log_path=Path(work) / "server.log") as server:
        print(f"vLLM server healthy after {time.perf_counter() - t0:.1f} s", flush=True)
        client = OpenAI(base_url=server.base_url, api_key="check")
        gaps, raw_gaps, rejected, tokens = [], [], 0, 0
        for k in range(n):
            out = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"What is {k % 10} + 4?"}], max_tokens=24,
                logprobs=True, temperature=TEMPERATURE, seed=k, response_format=FORMAT,
                extra_body={"return_token_ids": True})
            c = out.choices[0]
            prompt, ids = out.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
            sampled = torch.tensor([e.logprob for e in c.logprobs.content])
            bitmask = grammars.replay(constraint, ids)
            if bitmask is None:
                rejected += 1
                continue
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
            target = torch.tensor(ids).unsqueeze(1)
            masked = torch.log_softmax(logits + additive_mask(bitmask, logits.shape[-1]), -1).gather(1, target)[:, 0]
            plain = torch.log_softmax(logits, -1).gather(1, target)[:, 0]
            gaps.append((masked - sampled).abs())
            raw_gaps.append((plain - sampled).abs())
            tokens += len(ids)
            if k == 0:
                print(f"reply {c.message.content!r} ({c.finish_reason}), {len(ids)} ids")
        g, r = torch.cat(gaps), torch.cat(raw_gaps)
    return {"replies": n, "tokens": tokens, "rejected": rejected, "masked_mean": float(g.mean()),
            "masked_max": float(g.max()), "unmasked_mean": float(r.mean()), "unmasked_max": float(r.max())}


def main() -> None:
    m = measure()
    print(f"{m['replies']} replies, {m['tokens']} tokens, {m['rejected']} not accepted by the replayed grammar")
    print(f"mean |trainer masked - vLLM| = {m['masked_mean']:.2e} (max {m['masked_max']:.2e}); "
          f"unmasked = {m['unmasked_mean']:.2e} (max {m['unmasked_max']:.2e})")


if __name__ == "__main__":
    main()
