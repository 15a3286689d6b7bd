"""Memory of a trainer holding 1, 2, 4 policies of the sql cookbook's model: only adapters and optimizer states grow.

    python benchmarks/policies_memory.py --policies 1 2 4

For each N, in a fresh process: a GRPOTrainer with N policies (cookbook/sql/lightning.toml's train settings, one
peft adapter each on the one base model) takes one update over a synthetic batch with calls of every policy. It
prints the base's parameter bytes, the adapters' and the optimizer states' bytes (counted from the tensors), and
the process's peak resident memory (ru_maxrss, which also holds torch and the Python heap). Last,
`ratio=` the adapters' and optimizer states' bytes at the largest N over N times those of one policy (1.0: each
policy adds exactly one adapter and its optimizer state) and `base_ratio=` the base's bytes there over one's.
"""

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(n: int) -> dict:
    import torch

    from lightning_sdk import config, models
    from lightning_sdk.train.trainer import GRPOTrainer
    from lightning_sdk.transitions import Transition

    torch.set_num_threads(1)
    cfg = config.load(ROOT / "cookbook/sql/lightning.toml")
    path = models.resolve(cfg.model.name)
    train = cfg.train.model_copy(update={"device": "cpu"})
    policies = [config.Policy(f"p{i}", (f"c{i}",), train) for i in range(n)] if n > 1 else None
    tr = GRPOTrainer(path, train, dtype=cfg.model.dtype, policies=policies)
    comps = [f"c{i}" for i in range(n)] if n > 1 else [None]
    batch = [Transition(f"r{g}{k}", f"g{g}", f"s{g}{k}{c}", j, c, tuple(range(5, 69)), tuple(range(7, 39)), None,
                        float(k % 2)) for g in range(2) for k in range(4) for j, c in enumerate(comps)]
    tr.step(batch)

    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)
    adapters = [p for n_, p in tr.model.named_parameters() if "lora_" in n_]
    base = [p for n_, p in tr.model.named_parameters() if "lora_" not in n_]
    opt = [v for a in tr.adapters.values() for s in a.optimizer.state.values() for v in s.values()
           if torch.is_tensor(v) and v.dim() > 0]
    return {"policies": n, "base_bytes": nbytes(base), "adapter_bytes": nbytes(adapters),
            "optimizer_state_bytes": nbytes(opt),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one)))
        return
    rows = []
    for n in args.policies:  # a fresh process each: ru_maxrss is a process's peak
        out = subprocess.run([sys.executable, __file__, "--one", str(n)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    first, last = rows[0], rows[-1]
    grown = (last["adapter_bytes"] + last["optimizer_state_bytes"]) / last["policies"]
    print(f"ratio={grown / ((first['adapter_bytes'] + first['optimizer_state_bytes']) / first['policies']):.4f} "
          f"base_ratio={last['base_bytes'] / first['base_bytes']:.4f}")


if __name__ == "__main__":
    main()
