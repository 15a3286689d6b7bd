"""@rollout/@reward semantics, and how the worker records rollouts that fail."""

import asyncio
import math

import pytest

import lightning_sdk as ls
from lightning_sdk.agent import is_reward, is_rollout
from lightning_sdk.store import Store
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.job import RolloutJob

LLM = ls.LLM(base_url="http://127.0.0.1:9/v1", api_key="k", model="m")


@ls.rollout
def sync_agent(task, llm):
    return f"{task['x']}@{llm.model}"


@ls.rollout
async def async_agent(task, llm):
    await asyncio.sleep(0)
    return task["x"] * 2


@ls.reward
def exact(task, output):
    return float(output == task.get("want"))


def test_decorated_functions_stay_plain():
    assert sync_agent({"x": 1}, LLM) == "1@m"
    assert asyncio.iscoroutinefunction(async_agent)
    assert asyncio.run(async_agent({"x": 2}, LLM)) == 4
    assert exact({"want": 3}, 3) == 1.0
    assert is_rollout(sync_agent) and is_rollout(async_agent) and is_reward(exact)
    assert not is_reward(sync_agent)
    assert sync_agent.__name__ == "sync_agent"


def test_wrong_signature_is_refused_at_decoration():
    with pytest.raises(TypeError, match=r"rollout.*expected fn\(task\) or fn\(task, llm\)"):
        @ls.rollout
        def three_args(task, llm, extra):  # pragma: no cover - never called
            pass
    with pytest.raises(TypeError, match="rollout"):
        @ls.rollout
        def no_args():  # pragma: no cover
            pass
    with pytest.raises(TypeError, match="reward"):
        @ls.reward
        def three(task, output, extra):  # pragma: no cover
            pass


def test_plain_call_exceptions_propagate():
    @ls.rollout
    def broken(task, llm):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        broken({}, LLM)


def _run(store, fn, reward=exact, task=None, timeout=5.0, rid="r1"):
    job = RolloutJob(rollout_id=rid, task_id="t", group_id="0:0", task=task or {"x": 1, "want": "1@m"}, iteration=0)
    return asyncio.run(run_rollout(job, rollout_fn=fn, reward_fn=reward, llm=LLM, store=store, timeout=timeout))


def test_worker_records_success_sync_and_async(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    assert _run(store, sync_agent).reward == 1.0
    r = _run(store, async_agent, task={"x": 3, "want": 6}, rid="r2")
    assert r.status == "succeeded" and r.reward == 1.0
    rec = store.rollout("r2")
    assert rec.status == "succeeded" and rec.output == 6 and rec.reward == 1.0 and rec.ended_at >= rec.started_at
    assert [x["kind"] for x in store.rewards("r2")] == ["final"]


def test_a_rollout_of_the_task_alone_gets_no_llm(tmp_path):
    """`fn(task)`: an agent that builds its own OpenAI client from the environment takes no `llm` argument."""
    seen = []

    @ls.rollout
    def task_only(task):
        seen.append(task)
        return "1@m"

    @ls.rollout
    def llm_optional(task, llm=None):  # takes both shapes: it gets the llm
        seen.append(llm)
        return "1@m"

    store = Store(tmp_path / "s.sqlite")
    assert _run(store, task_only).reward == 1.0 and seen == [{"x": 1, "want": "1@m"}]
    assert _run(store, llm_optional, rid="r2").reward == 1.0 and seen[-1] == LLM
    assert task_only({"x": 5}) == "1@m"  # still a plain function


def test_agent_exception_is_a_failed_rollout_with_traceback(tmp_path):
    store = Store(tmp_path / "s.sqlite")

    @ls.rollout
    def broken(task, llm):
        raise KeyError("question")

    r = _run(store, broken)
    assert r.status == "failed" and r.reward is None
    rec = store.rollout("r1")
    assert rec.status == "failed" and "KeyError" in rec.error and "raise KeyError" in rec.traceback


def test_hung_agent_times_out(tmp_path):
    store = Store(tmp_path / "s.sqlite")

    @ls.rollout
    async def hangs(task, llm):
        await asyncio.sleep(60)

    r = _run(store, hangs, timeout=0.2)
    assert r.status == "failed" and "rollout.timeout=0.2" in r.error
    assert store.rollout("r1").status == "failed"


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, "1.0", [1.0]])
def test_bad_reward_names_rollout_and_value(tmp_path, bad):
    store = Store(tmp_path / "s.sqlite")

    @ls.reward
    def score(task, output):
        return bad

    r = _run(store, sync_agent, reward=score, rid="rollout-xyz")
    assert r.status == "failed"
    assert "rollout-xyz" in r.error and repr(bad) in r.error
    # None was returned, nothing raised: said as such; the others are numbers of the wrong kind
    assert ("returned None for rollout rollout-xyz, expected a float" in r.error) if bad is None else \
        ("finite float" in r.error)
    assert store.rollout("rollout-xyz").reward is None


def test_async_reward_and_bool_reward(tmp_path):
    store = Store(tmp_path / "s.sqlite")

    @ls.reward
    async def score(task, output):
        return output == "1@m"

    assert _run(store, sync_agent, reward=score).reward == 1.0


def test_emit_reward_checks_value_even_outside_a_rollout():
    ls.emit_reward(0.5)  # no rollout: nothing recorded, no error
    with pytest.raises(ValueError, match="finite number"):
        ls.emit_reward(float("nan"))
    with pytest.raises(ValueError):
        ls.emit_reward("1")


# ------------------------------------------------------------------------------ faults injected into the agent

def _job(rid, task=None):
    return RolloutJob(rollout_id=rid, task_id="t", group_id="0:0", task=task or {"x": 1, "want": "1@m"},
                      iteration=0)


def test_hung_sync_agents_neither_starve_the_rest_nor_block_the_run(tmp_path):
    """A sync agent that never returns keeps its thread (Python cannot kill one), but nothing waits for it."""
    import threading

    store = Store(tmp_path / "s.sqlite")
    forever = threading.Event()

    @ls.rollout
    def hangs(task, llm):
        forever.wait()

    async def phase():
        hung = [run_rollout(_job(f"hung{i}"), rollout_fn=hangs, reward_fn=exact, llm=LLM, store=store, timeout=0.3)
                for i in range(40)]  # far more than the loop's default thread pool holds
        failed = await asyncio.gather(*hung)
        ok = await asyncio.gather(*(run_rollout(_job(f"ok{i}"), rollout_fn=sync_agent, reward_fn=exact, llm=LLM,
                                                store=store, timeout=5) for i in range(10)))
        return failed, ok

    runner = asyncio.Runner()
    failed, ok = runner.run(phase())
    runner.close()  # with the default executor this would join the 40 hung threads: forever
    assert all(r.status == "failed" and "rollout.timeout=0.3" in r.error for r in failed)
    assert all(r.status == "succeeded" and r.reward == 1.0 for r in ok)
    assert len(store.rollouts(status="failed")) == 40 and len(store.rollouts(status="succeeded")) == 10
    forever.set()


def test_hung_sync_agent_does_not_keep_the_process_alive(tmp_path):
    import subprocess
    import sys

    script = f"""
import asyncio, threading
import lightning_sdk as ls
from lightning_sdk.store import Store
from lightning_sdk.rollouts.episode import run_rollout
from lightning_sdk.rollouts.job import RolloutJob

@ls.rollout
def hangs(task, llm):
    threading.Event().wait()

@ls.reward
def score(task, output):
    return 0.0

job = RolloutJob(rollout_id="r", task_id="t", group_id="g", task={{}}, iteration=0)
llm = ls.LLM(base_url="http://127.0.0.1:9/v1", api_key="k", model="m")
store = Store({str(tmp_path / 's.sqlite')!r})
r = asyncio.run(run_rollout(job, rollout_fn=hangs, reward_fn=score, llm=llm, store=store, timeout=0.3))
print("status", r.status)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "status failed" in out.stdout


def test_agent_returning_none_is_scored_by_reward(tmp_path):
    """The rule: None is an output like any other; the rollout fails only if @reward cannot score it."""
    store = Store(tmp_path / "s.sqlite")

    @ls.rollout
    def nothing(task, llm):
        return None

    @ls.reward
    def tolerant(task, output):
        return 0.0 if output is None else 1.0

    @ls.reward
    def strict(task, output):
        return float(output.strip() == "1")

    r = _run(store, nothing, reward=tolerant, rid="none-ok")
    assert r.status == "succeeded" and r.reward == 0.0 and store.rollout("none-ok").output is None
    r = _run(store, nothing, reward=strict, rid="none-bad")
    assert r.status == "failed" and r.failed_in == "reward"
    assert r.error.startswith("@reward raised AttributeError") and "none-bad" in r.error
    assert "output.strip()" in store.rollout("none-bad").traceback


def test_reward_exception_and_hang_are_reward_failures(tmp_path):
    store = Store(tmp_path / "s.sqlite")

    @ls.reward
    def raises(task, output):
        raise ZeroDivisionError("no score")

    @ls.reward
    async def hangs(task, output):
        await asyncio.sleep(60)

    r = _run(store, sync_agent, reward=raises, rid="rw-raise")
    assert r.failed_in == "reward" and "ZeroDivisionError: no score" in r.error and "rw-raise" in r.error
    r = _run(store, sync_agent, reward=hangs, rid="rw-hang", timeout=0.3)
    assert r.failed_in == "reward" and "@reward for rollout rw-hang took longer" in r.error
    r = _run(store, async_agent, rid="agent-fails", task={"y": 1})
    assert r.failed_in == "rollout"


def test_missing_task_field_is_named(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    r = _run(store, sync_agent, task={"question": "q"}, rid="r-key")
    assert r.status == "failed"
    assert "task t has no field 'x'" in r.error and "'question'" in r.error and "data.required_fields" in r.error
