"""Every name an earlier version wrote to metrics.jsonl reads as today's one name (lightning_sdk/metric_names.py),
and today's names, labels and text fields pass through unchanged."""

from lightning_sdk import metric_names as names

# A row as an earlier version wrote it (iteration.Batch.row, loop._save_and_serve, pipeline.Staleness.metrics),
# and an eval row (metrics.eval_row).
OLD_ROW = {"iteration": 3, "policy": "run-it2", "reward_mean": 0.5, "reward_std": 0.1, "rollouts": 8, "failed": 1,
           "transitions": 14, "completion_tokens": 900, "failed_trained": 0, "skipped.truncated": 2,
           "collect_s": 1.5, "update_s": 0.7, "sleep_s": 0.1, "hotload_s": 0.2, "elapsed_s": 9.0,
           "train.loss": -0.01, "train.kl": 0.002, "train.seconds": 0.6, "train.staleness_mean": 0.5,
           "train.planner.loss": 0.3, "transitions.planner": 6, "base_calls": 2}
OLD_EVAL = {"phase": "eval", "eval": "trained", "iteration": 3, "eval.reward_mean": 0.8, "eval_stderr": 0.05,
            "eval_tasks": 20, "eval_failed": 1, "eval_failures": "1 RewardError", "eval_split": "held-out"}


def test_old_names_read_as_todays():
    assert names.current_row(OLD_ROW) == {
        "iteration": 3, "policy": "run-it2", names.REWARD_MEAN: 0.5, names.REWARD_STD: 0.1, names.ROLLOUTS: 8,
        names.FAILED: 1, names.TRANSITIONS: 14, names.COMPLETION_TOKENS: 900, names.FAILED_TRAINED: 0,
        names.skipped("truncated"): 2, names.timing("collect_s"): 1.5, names.timing("update_s"): 0.7,
        names.timing("sleep_s"): 0.1, names.timing("hotload_s"): 0.2, names.timing("elapsed_s"): 9.0,
        names.train("loss"): -0.01, names.train("kl"): 0.002, names.train("seconds"): 0.6,
        names.train("staleness_mean"): 0.5, names.train("planner.loss"): 0.3,
        names.policy_transitions("planner"): 6, names.BASE_CALLS: 2}
    assert names.current_row(OLD_EVAL) == {
        "phase": "eval", "eval": "trained", "iteration": 3, names.EVAL_REWARD_MEAN: 0.8, names.EVAL_STDERR: 0.05,
        names.EVAL_TASKS: 20, names.EVAL_FAILED: 1, names.EVAL_FAILURES: "1 RewardError",
        names.EVAL_SPLIT: "held-out"}


def test_todays_names_are_fixed_points():
    for row in (OLD_ROW, OLD_EVAL):
        new = names.current_row(row)
        assert names.current_row(new) == new
        assert all("/" in k or k in names.LABELS for k in new)


def test_both_spellings_keep_todays_value():
    assert names.current_row({"train.loss": 1.0, "train/loss": 2.0}) == {"train/loss": 2.0}


def test_summary_reads_old_and_new_rows_alike():
    from rich.console import Console

    from lightning_sdk.summary import iteration_table

    def text(history):
        console = Console(width=200, record=True, file=open("/dev/null", "w"))
        console.print(iteration_table("run", history, None, None, beta=0.1))
        return console.export_text()

    old = text([OLD_ROW])
    assert old == text([names.current_row(OLD_ROW)])
    assert "0.500" in old and "-0.01" in old and "1.5" in old  # reward, loss, collect seconds: read, not blank


def test_the_dashboard_reads_an_old_runs_metrics_under_todays_names(tmp_path):
    import json

    from lightning_sdk.dashboard.runs import RunReader

    run = tmp_path / "old"
    run.mkdir()
    stored = json.dumps(OLD_EVAL | {"iteration": 0}) + "\n" + json.dumps(OLD_ROW) + "\n" + json.dumps(OLD_EVAL) + "\n"
    (run / "metrics.jsonl").write_text(stored)
    reader = RunReader(tmp_path)
    [listed] = reader.runs()
    assert listed["last_reward"] == 0.5 and listed["eval"]["mean"] == 0.8 and listed["eval"]["failed"] == 1
    summary = reader.summary(listed["id"])
    [row] = summary["history"]
    assert {k: v for k, v in row.items() if k != "checkpoint"} == names.current_row(OLD_ROW)
    assert summary["sections"][names.train("loss")] == "train" and summary["sections"][names.REWARD_MEAN] == "rollout"
    assert summary["policies"] == ["planner"]
    assert [(e["mean"], e["stderr"], e["split"]) for e in summary["evals"]] == [(0.8, 0.05, "held-out")] * 2
    assert (run / "metrics.jsonl").read_text() == stored  # read, never rewritten
