"""The built-in server's streamed tool-call reading: a gpt-oss (harmony) reply of many messages streamed one message
per delta through toolcalls.StreamShaper, timed whole, with a reply of a tenth the length in the same run: `ratio`
is how the time grows for 10x the messages (linear reading: about 10; re-reading every message at every delta:
about 100).

    PYTHONPATH=$PWD python benchmarks/stream_shaper.py [--messages 1600]
"""

from __future__ import annotations

import argparse
import time

from lightning_sdk.engine import toolcalls


def stream(messages: int) -> float:
    shaper = toolcalls.StreamShaper(1, toolcalls.Reader(toolcalls.tool_format("openai")))
    parts = ["<|channel|>analysis<|message|>thinking about it<|end|>"] + [
        '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>'
        if k % 2 else "<|start|>assistant<|channel|>final<|message|>some text<|end|>" for k in range(1, messages)]
    start = time.perf_counter()
    calls = 0
    for k, part in enumerate(parts):
        delta, _ = shaper.delta(0, part, "stop" if k == len(parts) - 1 else None)
        calls += len(delta.get("tool_calls", []))
    elapsed = time.perf_counter() - start
    assert calls == messages // 2, calls
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1600)
    n = ap.parse_args().messages
    small, big = stream(n // 10), stream(n)
    print(f"{n} harmony messages as {n} deltas: {big:.3f} s; {n // 10}: {small:.4f} s; ratio={big / small:.1f}")


if __name__ == "__main__":
    main()
