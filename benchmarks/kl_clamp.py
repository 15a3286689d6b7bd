"""How often the k3 KL clamp (verl's low_var_kl bounds, train/grpo.py) acts in a real GRPO run: the tiny
arithmetic model learning sums with train.beta > 0, its own samples (the test suite's learn_arithmetic). Prints
P(correct) before and after, and the share of trained tokens (weighted as the loss) whose k3 value reached verl's
bound of 10 or whose log-ratio reached KL_LOG_RATIO_CLAMP: where a bound stops their KL gradient.

    PYTHONPATH=. python benchmarks/kl_clamp.py [--steps 40] [--beta 0.04] [--lr 5e-3] [--bound off|on]
"""

from __future__ import annotations

import argparse

import torch

from lightning_sdk.train import grpo, trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--bound", choices=["on", "off"], default="off",
                    help="on: verl's bound of the k3 value to +-10; off (the trainer's): unbounded (TRL), its "
                         "log-ratio still clamped for finiteness")
    args = ap.parse_args()
    bound = 10.0  # the share reported: tokens at or past verl's bound, whether it acts or not
    seen = {"clamped": 0.0, "weight": 0.0, "max_k3": 0.0}
    loss = grpo.grpo_loss

    def counting(logp, old_logp, adv, weights, *, ref_logp=None, **kw):
        if ref_logp is not None:
            with torch.no_grad():
                d = ref_logp - logp
                k3 = torch.exp(d.clamp(-grpo.KL_LOG_RATIO_CLAMP, grpo.KL_LOG_RATIO_CLAMP)) - d - 1.0
                hit = (d.abs() >= grpo.KL_LOG_RATIO_CLAMP) | (k3.abs() >= bound)
                seen["clamped"] += float((weights * hit).sum())
                seen["weight"] += float(weights.sum())
                real = weights > 0
                seen["max_k3"] = max(seen["max_k3"], float(k3[real].max()) if real.any() else 0.0)
        return loss(logp, old_logp, adv, weights, ref_logp=ref_logp, kl_bound=bound if args.bound == "on" else None,
                    **kw)

    trainer.grpo_loss = counting
    from lightning_sdk.models import load_tokenizer, resolve
    from tests.test_trainer import DEMO, learn_arithmetic

    path = resolve("builtin:tiny-arith")
    tok = load_tokenizer(path)
    tok.padding_side = "left"
    result = learn_arithmetic(path, tok, steps=args.steps,
                              **{**DEMO, "lr": args.lr, "beta": args.beta})
    share = seen["clamped"] / seen["weight"] if seen["weight"] else 0.0
    print(f"steps {args.steps}, beta {args.beta}, lr {args.lr}, bound {args.bound}: P(correct) {result['before']:.3f} -> "
          f"{result['after']:.3f}; clamped share of trained tokens {share:.2e}; largest k3 {seen['max_k3']:.3g} "
          f"(bound {bound:g}; share: tokens at or past it)")


if __name__ == "__main__":
    main()
