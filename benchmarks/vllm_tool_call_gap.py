"""Tool calls sampled by vLLM, scored as the trainer scores them: vLLM's CPU build (as a run starts it, with the
hermes tool parser) serves the calc cookbook's tiny model requests that offer its calculator, with and without
`"strict": true`, forced ("required", the named function) and not ("auto"); the grammar the gateway records
(constraint.from_request) is replayed over each reply's ids and the trainer's masked log-probs are compared with
vLLM's. A reply the replayed grammar does not accept is one the trainer leaves out (train.constraint_mismatch).

    PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 \
        .venv-vllm/bin/python benchmarks/vllm_tool_call_gap.py

vLLM runs in float32 here, so a gap is the grammar's and the kernels', not a precision's.
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

from lightning_sdk import config, models  # noqa: E402
from lightning_sdk.constraint import from_request  # noqa: E402
from lightning_sdk.grammar import Grammars, additive_mask  # noqa: E402
from lightning_sdk.servers.select import vllm_server  # noqa: E402

CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}
NAMED = {"type": "function", "function": {"name": "calculator"}}
CASES = {f"{choice} {strict}": {"tools": [{"type": "function", "function": {**CALCULATOR, **extra}}],
                                **({"tool_choice": tool_choice} if tool_choice else {})}
         for strict, extra in (("no strict", {}), ("strict", {"strict": True}))
         for choice, tool_choice in (("required", "required"), ("named", NAMED), ("auto", None))}
TEMPERATURE, N = 1.0, 8


def measure(n: int = N, cases: dict[str, dict] | None = None) -> dict[str, dict[str, float]]:
    """Per case: `n` replies from vLLM; how many the replayed grammar refused, and the mean and max |trainer -
    vLLM| log-prob over the others' tokens."""
    cases = CASES if cases is None else cases
    path = models.resolve(f"tiny:{ROOT / 'cookbook/calc/teacher.py'}")
    tok, model = models.load_tokenizer(path), models.load_causal_lm(path, dtype="float32")
    grammars = Grammars(tok, int(model.get_output_embeddings().weight.shape[0]), models.eos_ids(model, tok))
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as work:
        cfg = config.parse({"agent": {"module": "agent.py"}, "data": {"train": "t.jsonl"},
                            "model": {"name": "tiny", "dtype": "float32"},
                            "serve": {"backend": "vllm", "sleep_level": 0, "max_model_len": 1024,
                                      "startup_timeout": 900}, "run": {"dir": str(Path(work) / "run")}})
        t0 = time.perf_counter()
        with vllm_server(cfg, path, Path(work) / "server.log") as server:
            print(f"vLLM server healthy after {time.perf_counter() - t0:.1f} s", flush=True)
            client = OpenAI(base_url=server.base_url, api_key=server.api_key)
            for name, body in cases.items():
                constraint = from_request(body)
                gaps, rejected, tokens, calls = [], 0, 0, 0
                for k in range(n):
                    r = client.chat.completions.create(
                        model=server.served_model_name, max_tokens=64, logprobs=True, temperature=TEMPERATURE,
                        seed=k, extra_body={"return_token_ids": True}, **body, messages=[
                            {"role": "system", "content": "Solve the problem. Use the calculator, then give the "
                                                          "number."},
                            {"role": "user", "content": f"Ann has {k + 3} boxes with 8 pencils in each. How many "
                                                        f"pencils does Ann have?"}])
                    c = r.choices[0]
                    prompt, ids = r.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
                    calls += bool(c.message.tool_calls)
                    sampled = torch.tensor([e.logprob for e in c.logprobs.content])
                    bitmask = None if constraint is None else grammars.replay(constraint, ids)
                    if constraint is not None and bitmask is None:
                        rejected += 1
                        continue
                    with torch.no_grad():
                        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
                    logits = logits / TEMPERATURE
                    if bitmask is not None:
                        logits = logits + additive_mask(bitmask, logits.shape[-1])
                    got = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids).unsqueeze(1))[:, 0]
                    gaps.append((got - sampled).abs())
                    tokens += len(ids)
                g = torch.cat(gaps) if gaps else torch.zeros(1)
                out[name] = {"replies": n, "calls": calls, "tokens": tokens, "rejected": rejected,
                             "replayed": float(constraint is not None), "mean": float(g.mean()), "max": float(g.max())}
                print(f"{name:20s} {out[name]}", flush=True)
    grammars.close()
    return out


def main() -> None:
    for name, m in measure().items():
        print(f"{name}: {m['calls']} of {m['replies']} replies call, {m['rejected']} not accepted by the replayed "
              f"grammar{'' if m['replayed'] else ' (none recorded)'}; mean |trainer - vLLM| = {m['mean']:.2e} "
              f"(max {m['max']:.2e}) over {m['tokens']} tokens")


if __name__ == "__main__":
    main()
