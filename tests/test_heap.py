"""The run's startup objects are frozen out of the cyclic collector while it collects and trains, and handed back
when it ends (lightning_sdk/heap.py); what is made meanwhile is still collected."""

from __future__ import annotations

import gc
import weakref

from lightning_sdk.heap import frozen_heap
from lightning_sdk.store import Store
from tests.test_group_baseline import run_one_task


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_heap_freezes_what_exists_and_still_collects_what_is_made_later():
    assert gc.get_freeze_count() == 0
    before = Node()
    with frozen_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000  # the interpreter's and the test run's objects
        assert all(o is not before for o in gc.get_objects())  # frozen: in no generation the collector walks
        later = Node()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None  # a cycle made inside the block is collected
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects())  # handed back: collectable again


def test_frozen_heap_leaves_a_freeze_it_did_not_make_alone():
    mine = Node()
    gc.freeze()
    try:
        with frozen_heap() as frozen:
            assert frozen == 0
        assert gc.get_freeze_count() > 0 and all(o is not mine for o in gc.get_objects())  # still frozen
    finally:
        gc.unfreeze()


AGENT = '''
import gc
from openai import OpenAI
import lightning_sdk as ls

@ls.rollout
def solve(task, llm):
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client.chat.completions.create(model=llm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    return str(gc.get_freeze_count())

@ls.reward
def score(task, output):
    return float(int(output) > 0)
'''


def test_a_run_collects_with_its_startup_heap_frozen_and_unfreezes_at_its_end(tmp_path):
    run_one_task(tmp_path, AGENT, group_size=2, concurrency=2)
    rollouts = Store(tmp_path / "run/store.sqlite").rollouts(phase="train")
    assert len(rollouts) == 2 and all(r.status == "succeeded" and r.reward == 1.0 for r in rollouts), rollouts
    assert all(int(r.output) > 10_000 for r in rollouts)  # the libraries, the model, the servers: all frozen
    assert gc.get_freeze_count() == 0
