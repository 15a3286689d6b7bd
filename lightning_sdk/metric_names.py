"""The one name of each number a run logs, in metrics.jsonl, every tracker, the console and the dashboard: grouped
by a "/" as TensorBoard, W&B and MLflow users expect (`train/loss`, `rollout/reward_mean`, `time/collect_s`,
`eval/reward_mean`), and `current()`, which reads a name an earlier version wrote (`train.loss`, `reward_mean`,
`collect_s`, `eval.reward_mean`, `eval_stderr`) as today's. The table of names is in docs/observability.md."""

from __future__ import annotations

from typing import Any

# The x axis of every chart and tracker, and the row's labels: not metrics, never renamed.
ITERATION = "iteration"
LABELS = frozenset({"iteration", "step", "policy", "phase", "eval"})

# The rollouts an iteration collected: what they scored and what they left to train on.
REWARD_MEAN = "rollout/reward_mean"
REWARD_STD = "rollout/reward_std"
ROLLOUTS = "rollout/rollouts"
FAILED = "rollout/failed"
FAILED_TRAINED = "rollout/failed_trained"  # failed rollouts trained at rollout.failed_reward
TRANSITIONS = "rollout/transitions"
COMPLETION_TOKENS = "rollout/completion_tokens"
BASE_CALLS = "rollout/base_calls"  # with [policies]: calls of components in no policy

# An eval pass (untrained at step 0, trained at step run.iterations).
EVAL_REWARD_MEAN = "eval/reward_mean"
EVAL_STDERR = "eval/stderr"
EVAL_TASKS = "eval/tasks"
EVAL_FAILED = "eval/failed"
EVAL_FAILURES = "eval/failures"  # text: how many failed and why
EVAL_SPLIT = "eval/split"  # text: train, held-out or mixed

# The counts an iteration's rollouts were left to train on, in groups of their own.
_ROLLOUT_COUNTS = ("reward_mean", "reward_std", "rollouts", "failed", "failed_trained", "transitions",
                   "completion_tokens", "base_calls")


def train(key: str) -> str:
    """An update's number as the trainer names it (`loss`, `kl`, ...; with [policies] one per policy, `planner.loss`
    -> `train/planner/loss`)."""
    return "train/" + key.replace(".", "/")


def skipped(reason: str) -> str:
    """How many calls, rollouts or rewards an iteration left out for `reason`."""
    return f"rollout/skipped/{reason}"


def policy_transitions(policy: str) -> str:
    """With [policies]: the calls one policy trained on."""
    return f"{TRANSITIONS}/{policy}"


def timing(name: str) -> str:
    """A phase's seconds: `name` ends in `_s` (collect_s, update_s, hotload_s, sleep_s, wake_s, elapsed_s)."""
    return f"time/{name}"


def group(name: str) -> str:
    """Today's name's group (`train`, `rollout`, `time`, `eval`): TensorBoard's tag group, the dashboard's section."""
    return name.split("/", 1)[0] if "/" in name else "rollout"


def current(name: str) -> str:
    """A metrics.jsonl name as today's: an old one (dotted or bare) translated, today's and labels as they are.
    Every reader of a stored row goes through here (via `current_row`), so old runs read like new ones."""
    if "/" in name or name in LABELS:
        return name
    if name.startswith("eval.") or name.startswith("eval_"):
        return "eval/" + name[5:].replace(".", "/")
    if name.startswith("train."):
        return "train/" + name[6:].replace(".", "/")
    if name.startswith("skipped."):
        return skipped(name[8:])
    if name.startswith("transitions."):
        return policy_transitions(name[12:])
    if name in _ROLLOUT_COUNTS:
        return f"rollout/{name}"
    if name.endswith("_s"):
        return timing(name)
    return name


def current_row(row: dict[str, Any]) -> dict[str, Any]:
    """A stored row with today's names; the stored file is never rewritten. A name present in both spellings keeps
    today's value (a row is written by one version, so this happens only for hand-edited files)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        new = current(key)
        if new == key or new not in row:
            out[new] = value
    return out
