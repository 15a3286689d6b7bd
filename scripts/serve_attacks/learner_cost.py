"""Issue 52 item 6: the learner's read of the log for docs/serve.md's first app (calls of no episode, each rewarded
by its response id) as the log grows: CPU seconds of `rewarded.call_advantages` (every rewarded call's advantage
over the whole log) at 200, 400 and 800 rewards, and the growth exponent (cost ~ rewards^k)."""

from __future__ import annotations

import inspect
import math
import time

import httpx
import serving

SIZES = (200, 400, 800)


def cost(path) -> float:
    from lightning_sdk import credit
    from lightning_sdk.production.ledger import FeedbackLedger
    from lightning_sdk.production.rewarded import call_advantages
    from lightning_sdk.store import Store

    store, ledger = Store(path), FeedbackLedger(path)
    try:
        given = {"ledger": ledger, "store": store, "rule": credit.resolve("last_call")}
        args = [given[n] for n in inspect.signature(call_advantages).parameters if n in given]
        start = time.process_time()
        call_advantages(*args)
        return time.process_time() - start
    finally:
        ledger.close()
        store.close()


def main() -> None:
    with serving.serve() as s, httpx.Client(base_url=s.url, headers=s.headers, timeout=60) as c:
        took = []
        for n in SIZES:
            while len(took) < n:
                ask = [{"role": "user", "content": f"What is {len(took)}?"}]
                r = c.post("/chat/completions", json={"model": "gpt-4o-mini", "max_tokens": 2, "messages": ask})
                f = c.post("/feedback", json={"response_id": r.json()["id"], "value": float(len(took) % 2)})
                f.raise_for_status()
                took.append(r.json()["id"])
            secs = cost(s.directory / "serve.sqlite")
            serving.emit(6, f"call_advantages CPU s at {n} rewards (calls of no episode, by response id)",
                         f"{secs:.3f}")
            if n == SIZES[0]:
                first = secs
        k = math.log(max(secs, 1e-6) / max(first, 1e-6)) / math.log(SIZES[-1] / SIZES[0])
        serving.emit(6, f"its growth exponent over {SIZES[0]}-{SIZES[-1]} rewards", f"{k:.2f}")


if __name__ == "__main__":
    main()
