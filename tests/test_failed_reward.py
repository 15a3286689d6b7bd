"""rollout.failed_reward on a real in-process Runtime (tiny model, real server, real store): a rollout whose agent
raised trains its captured call at failed_reward; one that hung past rollout.timeout is never penalised."""

import io
import json

from rich.console import Console

from lightning_sdk.runtime import Runtime
from lightning_sdk.store import Store
from tests.test_runtime_faults import make_project, task


def test_failed_rollouts_train_at_failed_reward_but_timeouts_do_not(tmp_path):
    rows = [task(1, 2, "raise"), task(2, 2), task(3, 2, "hang"), task(4, 2)]
    cfg = make_project(tmp_path, rows, run='name = "fr"\ndir = "run"\niterations = 1',
                       data='train = "train.jsonl"\ntasks_per_iteration = 4\ngroup_size = 2\nshuffle = false',
                       rollout="concurrency = 16\ntimeout = 20.0\nfailed_reward = -1.0")
    Runtime(cfg, console=Console(file=io.StringIO())).run()
    (m,) = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert m["rollout/failed"] == 4 and m["rollout/failed_trained"] == 2  # the two "raise" rollouts, not the two that hung
    assert m["rollout/transitions"] == 4 + 2  # one call per rollout: 4 succeeded + 2 raised
    store = Store(tmp_path / "run/store.sqlite")
    assert {r.error.split(":")[0] for r in store.rollouts(status="failed")} == {"RuntimeError", "TimeoutError"}
