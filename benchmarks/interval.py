"""A 95% bootstrap interval for a figure computed from samples: how far this machine's noise lets one run say.

    from interval import bootstrap
    lo, hi = bootstrap(lambda a, b: mean(a) / mean(b), ours, theirs, paired=True)

`paired`: the samples are rounds (the i-th of each measured together), resampled together; otherwise each list
is resampled on its own. Percentile interval over `n` resamples, from a fixed seed (the same data, the same
interval).
"""

import random
from typing import Callable, Sequence


def bootstrap(stat: Callable[..., float], *samples: Sequence[float], paired: bool = False, n: int = 2000,
              seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    figures = []
    for _ in range(n):
        if paired:
            picks = [rng.randrange(len(samples[0])) for _ in samples[0]]
            figures.append(stat(*([s[i] for i in picks] for s in samples)))
        else:
            figures.append(stat(*(rng.choices(s, k=len(s)) for s in samples)))
    figures.sort()
    return figures[int(0.025 * n)], figures[int(0.975 * n) - 1]
