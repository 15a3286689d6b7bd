"""A run directory as `lightning run` leaves it after many iterations, made directly (no model, no server): its
store.sqlite written through the project's own Store (tasks, rollouts started and finished, the gateway's call
records by `write_calls`, tool and reward spans by `write_spans`), metrics.jsonl, config.json, outcome.json and
the newest three checkpoints' state.json. What the dashboard and `lightning traces` read at a user's scale; the
dashboard scale test and benchmarks/dashboard_scale.py build theirs here.

Each iteration collects `group_size` rollouts of each of its tasks: most succeed with a reward, some fail (an
agent error with its traceback), a few are abandoned and retried as attempt 2; an eval pass of `eval_tasks`
rollouts comes before training (iteration 0) and after it. Each rollout makes `calls` LLM calls, each re-sending
the conversation so far (prompt ids and messages as the gateway records them), a tool span between calls and an
intermediate reward after the first call.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_sdk import config as config_mod
from lightning_sdk import metric_names as names
from lightning_sdk.store import Store
from lightning_sdk.tracing.records import (AFTER_CALL, API, ATTEMPT, COMPLETION_IDS, COMPLETION_LOGPROBS,
                                           COMPONENT, POLICY, PROMPT_IDS, REWARD_NAME, REWARD_SPAN, REWARD_VALUE,
                                           ROLLOUT_ID, SpanRecord)
from lightning_sdk.train.checkpoint import ADAPTER, CHECKPOINTS, STATE, TRAINER, RunState, checkpoint_name

SYSTEM = "You are a careful assistant. Use the calculator tool when a step needs arithmetic, then answer."


@dataclass(frozen=True)
class BigRun:
    """What was built: the directory, and ids a reader can ask for."""

    path: Path
    rollouts: int
    spans: int
    iterations: int
    last_rollout: str  # a succeeded train rollout of the last iteration (a rollout page with a group to explain)


class RunWriter:
    """Writes a run's store one phase at a time, as the runtime does: an eval pass, then iterations."""

    def __init__(self, store: Store, *, per_iteration: int, group_size: int = 4, eval_tasks: int = 100,
                 calls: int = 3, seed: int = 0):
        self.store, self.group_size, self.calls = store, group_size, calls
        self.tasks_per_iteration = max(1, per_iteration // group_size)
        self.rng = random.Random(seed)
        self.train = [{"id": f"train-{i:05d}", "question": f"What is {i} plus {i % 97} times 3?",
                       "answer": str(i + i % 97 * 3)} for i in range(max(self.tasks_per_iteration * 4, 64))]
        self.evals = [{"id": f"eval-{i:04d}", "question": f"What is {i} minus 7, halved?", "answer": str((i - 7) / 2)}
                      for i in range(eval_tasks)]
        store.add_tasks((task["id"], task) for task in self.train + self.evals)
        self.t = time.time() - 3600.0 * 24  # a day ago: the run's first rollout
        self.rollouts = self.spans = 0
        self.last = ""
        self._calls: list[SpanRecord] = []
        self._agent: list[SpanRecord] = []

    def eval_pass(self, it: int, label: str) -> None:
        for i, task in enumerate(self.evals):
            status = "succeeded" if self.rng.random() > 0.05 else "failed"
            self._rollout(f"eval-{label}-{i:04d}-{self.rng.getrandbits(32):08x}", task, f"eval:{label}:{i}", it,
                          "eval", 1, status)
        self._flush()

    def iteration(self, it: int) -> tuple[list[str], list[float], int]:
        """Iteration `it`'s rollouts: (the succeeded ones' ids, their rewards, how many were collected)."""
        ok, rewards, n = [], [], 0
        batch = [self.train[(it * self.tasks_per_iteration + i) % len(self.train)]
                 for i in range(self.tasks_per_iteration)]
        for i, task in enumerate(batch):
            for g in range(self.group_size):
                rid = f"it{it:04d}-{i:03d}-{g}-{self.rng.getrandbits(32):08x}"
                roll = self.rng.random()
                status = "succeeded" if roll > 0.08 else "failed" if roll > 0.01 else "abandoned"
                reward = self._rollout(rid, task, f"{it}:{i}", it, "train", 1, status)
                n += 1
                if status == "abandoned":  # RolloutJob.retry: attempt 2 under a new id
                    rid += "-r2"
                    reward = self._rollout(rid, task, f"{it}:{i}", it, "train", 2, "succeeded")
                if reward is not None:
                    ok.append(rid)
                    rewards.append(reward)
                    self.last = rid
        self._flush()
        return ok, rewards, n

    def _rollout(self, rid: str, task: dict, group: str, it: int, phase: str, attempt: int,
                 status: str) -> float | None:
        rng, store = self.rng, self.store
        store.start_rollout(rid, task_id=task["id"], group_id=group, iteration=it, phase=phase, attempt=attempt,
                            model=f"run-iter{it - 1}" if it > 1 else "base")
        trace = f"{rng.getrandbits(128):032x}"
        ns = int(self.t * 1e9) + 1_000_000
        convo = [{"role": "system", "parts": [{"type": "text", "content": SYSTEM}]},
                 {"role": "user", "parts": [{"type": "text", "content": task["question"]}]}]
        prompt = [rng.randrange(5, 32000) for _ in range(60 + len(task["question"]))]
        made = self.calls if status != "abandoned" else 1
        for k in range(made):
            completion = [rng.randrange(5, 32000) for _ in range(rng.randrange(12, 40))]
            reply = f"Step {k + 1}: {' '.join(str(c % 1000) for c in completion[:8])}"
            span_id = f"{rng.getrandbits(64):016x}"
            end = ns + rng.randrange(20, 400) * 1_000_000
            self._calls.append(SpanRecord(
                span_id=span_id, trace_id=trace, parent_id=None, rollout_id=rid, attempt=attempt,
                component="solver", name="chat run", start_ns=ns, end_ns=end, status="OK", status_message=None,
                source="gateway", attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.provider.name": "lightning",
                    "gen_ai.request.model": "run", "gen_ai.response.model": f"run-iter{it}", API: "chat.completions",
                    POLICY: f"run-iter{it}", "gen_ai.input.messages": json.dumps(convo),
                    "gen_ai.request.temperature": 1.0, "gen_ai.request.max_tokens": 64,
                    ROLLOUT_ID: rid, ATTEMPT: attempt, COMPONENT: "solver",
                    "gen_ai.response.finish_reasons": ["stop"],
                    "gen_ai.output.messages": json.dumps([{"role": "assistant", "finish_reason": "stop",
                                                           "parts": [{"type": "text", "content": reply}]}]),
                    PROMPT_IDS: list(prompt), COMPLETION_IDS: completion,
                    COMPLETION_LOGPROBS: [round(-rng.random() * 3, 4) for _ in completion],
                    "gen_ai.usage.input_tokens": len(prompt), "gen_ai.usage.output_tokens": len(completion),
                    "gen_ai.response.id": f"chatcmpl-{span_id}"}))
            self.spans += 1
            ns = end + 1_000_000
            if k == 0:
                self._agent.append(_span(rng, trace, rid, attempt, REWARD_SPAN, ns, ns + 10_000, "OK", {
                    REWARD_VALUE: 0.5, REWARD_NAME: "format", AFTER_CALL: span_id}))
                self.spans += 1
            if k + 1 < made:
                tool_ok = rng.random() > 0.05
                self._agent.append(_span(rng, trace, rid, attempt, "tool.calculator", ns, ns + 2_000_000,
                                         "OK" if tool_ok else "ERROR", {
                                             "gen_ai.operation.name": "execute_tool", "tool.input": reply[:40],
                                             "tool.output": str(rng.randrange(1000))}))
                self.spans += 1
                ns += 3_000_000
                convo = convo + [{"role": "assistant", "parts": [{"type": "text", "content": reply}]},
                                 {"role": "tool", "parts": [{"type": "tool_call_response", "id": f"call{k}",
                                                             "response": str(rng.randrange(1000))}]}]
                prompt = prompt + completion + [rng.randrange(5, 32000) for _ in range(12)]
        self.t = ns / 1e9 + 0.01
        self.rollouts += 1
        if status == "succeeded":
            reward = round(rng.random(), 3)
            store.finish_rollout(rid, status="succeeded", output=f"The answer is {rng.randrange(1000)}", reward=reward)
            return reward
        if status == "failed":
            store.finish_rollout(rid, status="failed", output=None, error="ValueError: could not parse the model's "
                                 "answer", traceback="Traceback (most recent call last):\n  File \"agent.py\", line "
                                 "12, in solve\nValueError: could not parse the model's answer")
            return None
        store.abandon(rid, f"the inference server died during the rollout; re-run as {rid}-r2")
        return None

    def _flush(self) -> None:
        self.store.write_calls(self._calls)
        self.store.write_spans(self._agent)
        self._calls.clear()
        self._agent.clear()


def history_row(rng: random.Random, it: int, rollouts: int, rewards: list[float], calls: int) -> dict:
    """Iteration `it`'s metrics.jsonl row, with the names and the kinds of numbers a run logs."""
    mean = sum(rewards) / len(rewards)
    return {
        names.ITERATION: it, "policy": "base" if it == 1 else f"run-iter{it - 1}", names.REWARD_MEAN: mean,
        names.REWARD_STD: (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
        names.ROLLOUTS: rollouts, names.FAILED: rollouts - len(rewards), names.TRANSITIONS: len(rewards) * calls,
        names.COMPLETION_TOKENS: len(rewards) * calls * 26, names.FAILED_TRAINED: 0,
        names.timing("collect_s"): 4.0 + rng.random(), names.timing("update_s"): 2.0 + rng.random(),
        names.timing("hotload_s"): 0.1, names.timing("elapsed_s"): 7.0 * it,
        **{names.train(k): rng.random() for k in ("loss", "grad_norm", "clip_frac", "kl", "entropy")}}


def build_run(path: Path, *, rollouts: int = 10_000, iterations: int = 200, group_size: int = 4,
              eval_tasks: int = 100, calls: int = 3, seed: int = 0) -> BigRun:
    """A finished run of at least `rollouts` rollouts: train ones spread over `iterations` (each a whole number of
    groups), two eval passes, and the retries of the abandoned ones."""
    path.mkdir(parents=True, exist_ok=True)
    per_iteration = math.ceil(max(1, rollouts - 2 * eval_tasks) / iterations / group_size) * group_size
    history: list[dict] = []
    with Store(path / "store.sqlite") as store:
        w = RunWriter(store, per_iteration=per_iteration, group_size=group_size, eval_tasks=eval_tasks, calls=calls,
                      seed=seed)
        w.eval_pass(0, "untrained")
        for it in range(1, iterations + 1):
            _, rewards, n = w.iteration(it)
            history.append(history_row(w.rng, it, n, rewards, calls))
        w.eval_pass(iterations, "trained")
    write_run_files(path, history, iterations=iterations, group_size=group_size,
                    tasks_per_iteration=w.tasks_per_iteration, eval_tasks=eval_tasks)
    return BigRun(path, w.rollouts, w.spans, iterations, w.last)


def write_run_files(path: Path, history: list[dict], *, iterations: int, group_size: int, tasks_per_iteration: int,
                    eval_tasks: int) -> None:
    """metrics.jsonl (the eval rows around the iterations'), config.json, outcome.json and the checkpoints
    write_checkpoint keeps (the newest three; their trainer/adapter/ is left empty: no reader here loads it)."""
    evaluated = {"phase": "eval", "eval": "trained", names.ITERATION: iterations, names.EVAL_REWARD_MEAN: 0.6,
                 names.EVAL_STDERR: 0.03, names.EVAL_TASKS: eval_tasks, names.EVAL_SPLIT: "held-out",
                 names.EVAL_FAILED: 0}
    before = {**evaluated, "eval": "untrained", names.ITERATION: 0, names.EVAL_REWARD_MEAN: 0.3}
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [before, *history, evaluated]))
    cfg = config_mod.parse({"agent": {"module": "agent.py"},
                            "data": {"train": "train.jsonl", "eval": "eval.jsonl", "group_size": group_size,
                                     "tasks_per_iteration": tasks_per_iteration},
                            "run": {"iterations": iterations, "dir": str(path)}}, base=path.parent)
    (path / config_mod.RUN_CONFIG_FILE).write_text(json.dumps(config_mod.effective(cfg), indent=1, sort_keys=True))
    (path / config_mod.OUTCOME_FILE).write_text(json.dumps({"status": "finished", "reason": None, "pid": 0,
                                                            "time": time.time()}))
    for it in range(max(1, iterations - 2), iterations + 1):
        checkpoint = path / CHECKPOINTS / checkpoint_name(it)
        (checkpoint / TRAINER / ADAPTER).mkdir(parents=True, exist_ok=True)
        state = RunState(completed=it, history=history[:it], baseline_eval=0.3, adapter_name=f"run-iter{it}")
        (checkpoint / STATE).write_text(state.to_json())


def _span(rng: random.Random, trace: str, rid: str, attempt: int, name: str, start: int, end: int, status: str,
          attributes: dict) -> SpanRecord:
    return SpanRecord(span_id=f"{rng.getrandbits(64):016x}", trace_id=trace, parent_id=None, rollout_id=rid,
                      attempt=attempt, component="solver", name=name, start_ns=start, end_ns=end, status=status,
                      status_message=None if status == "OK" else "tool failed",
                      attributes={**attributes, ROLLOUT_ID: rid, ATTEMPT: attempt, COMPONENT: "solver"})
