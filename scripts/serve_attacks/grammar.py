"""Issue 52, item 5 (grammars block every caller), against a real `lightning serve` on the built-in tiny model from
whichever checkout is on PYTHONPATH: a plain chat's latency while 8 schemas compile (over the limits, and within
them), one request each of the issue's over-limit constraints, and the serve's memory after 200 distinct schemas.
Every wait is bounded: an attack that is not answered in time prints "no answer in N s" (the old server goes on
compiling it). Sizes are the issue's, except where `what` says smaller.

    PYTHONPATH=/work/before python scripts/serve_attacks/grammar.py    # before
    PYTHONPATH=$PWD python scripts/serve_attacks/grammar.py            # after
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (scripts/serve_attacks/serving.py)

PLAIN = {"model": "app", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 2}


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def properties(n: int, tag: str, *, required: bool = False) -> dict:
    props = {f"{tag}{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


def schema(s: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}


def ask(served: serving.Served, extra: dict, timeout: float) -> tuple[int | None, float, str]:
    """(status or None if no answer in `timeout`, seconds, the error message's start)."""
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout) as c:
            r = c.post(served.url + "/chat/completions", json={**PLAIN, **extra}, headers=served.headers)
    except httpx.TimeoutException:
        return None, time.perf_counter() - t0, ""
    message = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
    return r.status_code, time.perf_counter() - t0, message[:110]


def answer(status: int | None, seconds: float, message: str, timeout: float) -> str:
    if status is None:
        return f"no answer in {timeout:g} s"
    return f"{status} in {seconds:.2f} s" + (f": {message}" if message else "")


def answers(results: list[tuple[int | None, float, str]], timeout: float) -> str:
    done = [r for r in results if r[0] is not None]
    counts = ", ".join(f"{sum(r[0] == s for r in done)} x {s}" for s in sorted({r[0] for r in done}))
    late = len(results) - len(done)
    parts = ([f"{counts} within {max(r[1] for r in done):.1f} s"] if done else []) + \
        ([f"{late} no answer in {timeout:g} s"] if late else [])
    return "; ".join(parts)


def plain_chat(served: serving.Served, timeout: float = 60) -> float | None:
    status, seconds, _ = ask(served, {}, timeout)
    return seconds if status == 200 else None


def under_load(served: serving.Served, bodies: list[dict], timeout: float) -> tuple[str, str]:
    """The bodies sent at once, and the slowest of 3 plain chats sent meanwhile."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        jobs = [pool.submit(ask, served, b, timeout) for b in bodies]
        time.sleep(0.5)
        chats = [plain_chat(served, timeout) for _ in range(3)]
        results = [j.result() for j in jobs]
    worst = f"no answer in {timeout:g} s" if None in chats else f"{max(chats):.2f} s"
    return answers(results, timeout), worst


def rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (OSError, StopIteration):
            pass
    return total / 1024


def main() -> None:
    with serving.serve() as served:
        plain_chat(served)  # warm
        alone = statistics.median(plain_chat(served) or float("nan") for _ in range(5))
        serving.emit(5, "plain chat alone (median of 5)", f"{alone:.3f} s")

        within = [schema(properties(900, f"w{k}_")) for k in range(8)]
        got, worst = under_load(served, within, 60)
        serving.emit(5, "8 schemas of 900 optional properties (within the limits) at once: answers", got)
        serving.emit(5, "plain chat while those 8 of 900 properties compile (slowest of 3)", worst)

        before = rss_mib(served.proc.pid)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda k: ask(served, schema(properties(1000, f"r{k}_", required=True)), 60),
                                    range(200)))
        grown = rss_mib(served.proc.pid) - before
        took = time.perf_counter() - t0
        serving.emit(5, "200 distinct schemas of 1,000 required properties (~3 MB each by xgrammar's estimate; "
                        "the issue's 256), 4 at a time: answers", answers(results, 60) + f", {took:.0f} s in all")
        serving.emit(5, "serve's RSS growth after those 200 (compiled-grammar cache)", f"+{grown:.0f} MiB")

        deep = [schema(nested_objects(250 + k)) for k in range(8)]
        got, worst = under_load(served, deep, 60)
        serving.emit(5, "8 schemas of objects nested ~250 deep (~14 KiB) at once: answers", got)
        serving.emit(5, "plain chat while those 8 nested ~250 deep are sent (slowest of 3)", worst)

        singles = [("arrays nested 900 deep", schema(nested_arrays(900))),
                   ("a 20,000-value enum", schema({"enum": [f"value-{i}" for i in range(20000)]})),
                   ("100,000 choices", {"structured_outputs": {"choice": [f"c{i}" for i in range(100000)]}}),
                   ("a 100,000-rule grammar", {"structured_outputs": {"grammar": "root ::= r0\n" + "\n".join(
                       f'r{i} ::= "x" | r{i + 1}' for i in range(100000)) + '\nr100000 ::= "y"'}}),
                   ("a 31-byte pattern asking for ((a{0,30}){0,30}){0,30}",
                    schema({"type": "string", "pattern": "((a{0,30}){0,30}){0,30}"}))]
        for what, extra in singles:
            status, seconds, message = ask(served, extra, 15)
            serving.emit(5, f"one request: {what}", answer(status, seconds, message, 15))
        late = plain_chat(served, 30)
        serving.emit(5, f"plain chat after those {len(singles)}",
                     "no answer in 30 s" if late is None else f"{late:.2f} s")


if __name__ == "__main__":
    main()
