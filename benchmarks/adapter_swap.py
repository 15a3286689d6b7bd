"""From a finished update to the server answering with the new adapter: hot-load vs restarting the server.

    python benchmarks/adapter_swap.py --repeats 3

A real GRPO update of the tiny model (our trainer, one step on a synthetic batch) saves its LoRA adapter; it is
not timed. Then, alternating, each measured from the moment the adapter is on disk until the first chat
completion with it has come back:
  swap:    POST /v1/load_lora_adapter to the running server, one completion with the new adapter's name
  restart: stop the server, start a fresh one (process, model load), load the adapter, one completion
Prints the median of each and `ratio=<swap/restart>` last.
"""

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import openai
import torch

from lightning_sdk import config, models
from lightning_sdk.transitions import Transition
from lightning_sdk.servers.cpu import CPUServer
from lightning_sdk.train.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin:tiny-arith"

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=3)
args = p.parse_args()
torch.set_num_threads(1)
tmp = Path(tempfile.mkdtemp(prefix="ls-swap-bench-"))
path = models.resolve(MODEL)
tok = models.load_tokenizer(path)


def synthetic_batch(step: int) -> list[Transition]:
    rng = random.Random(step)
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                           add_generation_prompt=True, return_dict=True)["input_ids"])
    return [Transition(f"r{g}-{k}", f"g{g}", f"s{g}-{k}", 0, None, prompt,
                       tuple(rng.randrange(3, len(tok)) for _ in range(6)), None, rng.random())
            for g in range(4) for k in range(8)]


trainer = GRPOTrainer(path, config.load(ROOT / "lightning.toml").train, dtype="float32")
server = CPUServer(MODEL, served_model_name="policy", threads=1, log_path=tmp / "server.log")
server.start()


def answer(name: str) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
    client.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 3 + 4?"}],
                                   max_tokens=8)


times: dict[str, list[float]] = {"swap": [], "restart": []}
try:
    for k in range(args.repeats):
        for how in (("swap", "restart") if k % 2 == 0 else ("restart", "swap")):
            trainer.step(synthetic_batch(len(times["swap"]) + len(times["restart"])))
            name = f"policy-{how}-{k}"
            trainer.save_adapter(tmp / name)  # the update is finished: the clock starts
            t0 = time.perf_counter()
            if how == "restart":
                server.stop()
                server.start()
            server.load_adapter(name, str(tmp / name))
            answer(name)
            times[how].append(time.perf_counter() - t0)
            print(f"{how}: {times[how][-1]:.3f} s")
finally:
    server.stop()

swap, restart = statistics.median(times["swap"]), statistics.median(times["restart"])
print(f"swap (hot-load, median of {args.repeats}): {swap:.3f} s; restart (median of {args.repeats}): {restart:.3f} s")
print(f"ratio={swap / restart:.4f}")
