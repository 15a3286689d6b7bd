"""Before/after figures for the red team's round three (issue 36), from any checkout of this project:

    PYTHONPATH=CHECKOUT python scripts/red_team_figures.py

Loopback only, bounded: a real gateway with the work routes on a real store, in front of the built-in CPU server
on the tiny arith model. Prints one line per figure:
- bytes logged per request for a JSON body nested 10^4 deep, on chat, completions and Responses;
- bytes logged for 20,000 results for rollouts nobody holds (the workers' key);
- the planted-id attack: a worker learns 312 of its own call ids, predicts the next one (a Mersenne Twister's
  state rebuilt from 624 outputs), plants a span of its rollout under it, then another rollout makes its call:
  that rollout's gateway records kept, and whether the prediction hit (tests/test_call_ids.py's `predict_next`).
Each figure is measured in a child process whose stderr (every log line, tracebacks included) is counted.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

DEEP = 10_000
UNKNOWN_RESULTS = 20_000


def _serve(tmp: Path):
    """A server (tiny model), a gateway with the work routes and a store: (server, gateway, dispatch, store)."""
    from lightning_sdk.gateway.proxy import Gateway
    from lightning_sdk.rollouts.remote.dispatch import Dispatch
    from lightning_sdk.rollouts.remote.routes import work_router
    from lightning_sdk.servers.cpu import CPUServer
    from lightning_sdk.store import Store

    server = CPUServer("builtin:tiny-arith", served_model_name="policy", threads=1, max_model_len=128)
    server.start()
    store = Store(tmp / "store.sqlite")
    dispatch = Dispatch(store)
    gateway = Gateway(api_key="agents", rollouts=dispatch.rollouts)
    gateway.add_routes(work_router(dispatch, run_name="figures", api_key="agents", redirect_openai=True),
                       api_key="workers")
    gateway.capture.record_to(store)
    gateway.start([server.url], backend_key=server.api_key)
    gateway.policy = "policy"
    return server, gateway, dispatch, store


def child(what: str) -> None:
    import httpx

    from lightning_sdk.console import configure_output
    from lightning_sdk.rollouts.job import RolloutJob

    configure_output()  # the CLI's logging
    with tempfile.TemporaryDirectory() as d:
        server, gateway, dispatch, store = _serve(Path(d))
        logging.getLogger("lightning_sdk").warning("--- measuring %s", what)  # what is logged after it counts
        out: dict = {}
        agents = {"Authorization": "Bearer agents"}
        workers = {"Authorization": "Bearer workers"}
        with httpx.Client(base_url=gateway.url, timeout=60) as c:
            if what == "deep":
                fields = {"/v1/chat/completions": b'"messages": ', "/v1/completions": b'"prompt": ',
                          "/v1/responses": b'"input": '}
                for route, field in fields.items():
                    body = b'{"model": "m", ' + field + b"[" * DEEP + b"]" * DEEP + b"}"
                    try:
                        r = c.post(route, content=body, headers={**agents, "Content-Type": "application/json"})
                        out[route] = r.status_code
                    except httpx.HTTPError as e:  # the server reset the connection: no answer at all
                        out[route] = type(e).__name__
            elif what == "unknown":
                for i in range(UNKNOWN_RESULTS):
                    c.post(f"/v1/work/gone-{i}/result", headers=workers,
                           json={"worker": "w", "status": "succeeded", "reward": 1.0})
                out["sent"] = UNKNOWN_RESULTS
            elif what == "planted":
                jobs = [RolloutJob(rollout_id=f"r-{k}", task_id=f"t{k}", group_id="g", task={}, iteration=1)
                        for k in range(2)]
                dispatch.open(list(enumerate(jobs)), policy="policy", label="figures", timeout=60, deadline_s=600)
                attacker = c.post("/v1/work/claim", json={"worker": "evil"}, headers=workers).json()
                victim = c.post("/v1/work/claim", json={"worker": "good"}, headers=workers).json()
                chat = {"model": "m", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 1}
                seen = [int(c.post(attacker["llm"]["base_url"] + "/chat/completions", json=chat,
                                   headers=agents).headers["x-lightning-call-id"], 16) for _ in range(312)]
                from tests.test_call_ids import predict_next  # the attacker's Mersenne Twister clone

                guess = format(predict_next(seen), "016x")
                span = {"traceId": attacker["trace_id"], "spanId": guess, "name": "chat m", "startTimeUnixNano": "1",
                        "endTimeUnixNano": "2", "attributes": [
                            {"key": "lightning.rollout.id", "value": {"stringValue": attacker["rollout_id"]}},
                            {"key": "lightning.rollout.attempt", "value": {"intValue": "1"}},
                            {"key": "lightning.claim", "value": {"stringValue": attacker["secret"]}}]}
                c.post("/v1/traces", json={"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}, headers=workers)
                r = c.post(victim["llm"]["base_url"] + "/chat/completions", json=chat, headers=agents)
                gateway.capture.flush()
                kept = [s for s in store.spans(victim["rollout_id"]) if s.source == "gateway"]
                out = {"predicted": r.headers["x-lightning-call-id"] == guess,
                       "victim_records_kept": len(kept), "victim_calls_made": 1,
                       "attacker_spans": len(store.spans(attacker["rollout_id"]))}
        gateway.capture.flush()
        print(json.dumps(out), flush=True)
        gateway.stop()
        server.stop()


def main() -> None:
    for what in ("deep", "unknown", "planted"):
        with tempfile.TemporaryFile() as err:
            p = subprocess.run([sys.executable, __file__, what], stdout=subprocess.PIPE, stderr=err, text=True,
                               timeout=900)
            err.seek(0)
            logged = err.read()
        marks = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        result = marks[-1] if marks else {"rc": p.returncode}
        # only what was logged while measuring: between the child's start and end lines
        body = logged.split(b"--- measuring", 1)[-1]
        body = body.split(b"\n", 1)[1] if b"\n" in body else b""
        if what == "deep":
            print(f"deep JSON ({DEEP} levels) x3 routes: statuses {result}, {len(body)} bytes logged "
                  f"({len(body) / 3:.0f} per request)")
        elif what == "unknown":
            print(f"{UNKNOWN_RESULTS} results for unknown rollouts: {len(body)} bytes logged "
                  f"({len(body) / UNKNOWN_RESULTS:.2f} per result)")
        else:
            print(f"planted-id attack: {result}")


if __name__ == "__main__":
    child(sys.argv[1]) if len(sys.argv) > 1 else main()
