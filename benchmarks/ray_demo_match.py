"""The default demo (lightning.toml), shortened, through the embedded and the Ray runtime: reward start/end.

    python benchmarks/ray_demo_match.py --iterations 10
"""

import argparse
import tempfile
from pathlib import Path

from lightning_sdk import config
from lightning_sdk import metric_names as names
from lightning_sdk.runtime import Runtime

ROOT = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser()
p.add_argument("--iterations", type=int, default=10)
p.add_argument("--runtime", choices=["embedded", "ray", "both"], default="both")
args = p.parse_args()
for runtime in (["embedded", "ray"] if args.runtime == "both" else [args.runtime]):
    cfg = config.load(ROOT / "lightning.toml")
    cfg.run.iterations, cfg.run.runtime = args.iterations, runtime
    cfg.run.dir = Path(tempfile.mkdtemp(prefix=f"ls-{runtime}-"))
    cfg.data.eval = None
    cfg.ray.num_cpus, cfg.ray.object_store_memory = 2, 80 * 1024 * 1024
    state = Runtime(cfg).run()
    curve = [round(r[names.REWARD_MEAN], 3) for r in state.history]
    print(f"RESULT {runtime}: reward first {curve[0]:.3f} last {curve[-1]:.3f} curve {curve}")
