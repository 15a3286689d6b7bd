"""gpt-oss's architecture on vLLM's CPU build with LoRA off. A run always turns LoRA on, which makes vLLM serve an MoE
through its Triton MoE-LoRA kernel, absent from the CPU build; here `family:gpt-oss` is served by `vllm serve` as it
is, completions from the model's own token ids (vLLM renders gpt-oss's chat in harmony's o200k ids instead), and its
log-probs are compared with the trainer's model's.

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. <vLLM venv>/bin/python \\
        benchmarks/vllm_gpt_oss_no_lora.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_sdk import models  # noqa: E402

MESSAGES = [{"role": "system", "content": "Solve the problem. Use the calculator, then give the number."},
            {"role": "user", "content": "Ann has 12 boxes with 8 pencils in each. How many pencils does Ann have?"}]
PORT = 18777


def main() -> None:
    path = models.resolve("family:gpt-oss")
    tok = models.load_tokenizer(path)
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--dtype", "float32",
         "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(PORT),
         "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"], stdout=log, stderr=subprocess.STDOUT)
    try:
        start = time.monotonic()
        while True:
            if server.poll() is not None:
                sys.exit(f"vLLM exited ({server.returncode}); log {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(2)
        print(f"vLLM healthy after {time.monotonic() - start:.0f} s (log {log.name})")
        model = models.load_causal_lm(path, dtype="float32")
        prompt = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
        gaps = []
        for seed in range(4):
            r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=300, json={
                "model": path, "prompt": prompt, "max_tokens": 32, "temperature": 1.0, "seed": seed, "logprobs": 0,
                "return_token_ids": True})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            ids, served = choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
            mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids).unsqueeze(1))[:, 0]
            gaps.append((mine - served).abs())
        g = torch.cat(gaps)
        print(f"gpt-oss without LoRA: prompt {len(prompt)} ids, {len(g)} tokens; "
              f"gap={g.mean():.2e} (max {g.max():.2e})")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
