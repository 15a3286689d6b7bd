"""Bad config and data stop `lightning run` before anything is written: exit code 2, one line naming the key or
row, and no run directory (or an existing run left exactly as it was)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from lightning_sdk import cli

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "cookbook/arith/agent.py"
GOOD_ROWS = '{"question": "What is 1 + 2?", "answer": "3"}\n{"question": "What is 2 + 2?", "answer": "4"}\n'


def config(**sections: str) -> str:
    base = {"run": 'dir = "run"', "agent": f'module = "{AGENT}"',
            "data": 'train = "train.jsonl"\nrequired_fields = ["question", "answer"]'}
    base.update(sections)
    return "".join(f"[{name}]\n{body}\n" for name, body in base.items())


CASES = {
    "unknown key": (config(train="learning_rate = 1e-3"), GOOD_ROWS, "train.learning_rate: unknown key"),
    "wrong type": (config(rollout='timeout = "soon"'), GOOD_ROWS, "rollout.timeout:"),
    "bad choice": (config(rollout='on_reward_error = "ignore"'), GOOD_ROWS, "rollout.on_reward_error:"),
    "missing dataset": (config(data='train = "nope.jsonl"'), None, "nope.jsonl: file not found"),
    "empty dataset": (config(), "\n\n", "train.jsonl: no tasks"),
    "row without a field": (config(), GOOD_ROWS + '{"question": "What is 3 + 3?"}\n',
                            "train.jsonl, row 3: no field 'answer'"),
    "not a JSON object": (config(), GOOD_ROWS + "[1, 2]\n", "line 3: expected a JSON object"),
    "unknown model": (config(model='name = "builtin:gpt-17"'), GOOD_ROWS, "unknown builtin model"),
    "missing agent": (config(agent='module = "missing_agent.py"'), GOOD_ROWS, "file not found"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, case):
    toml, rows, message = CASES[case]
    (tmp_path / "lightning.toml").write_text(toml)
    if rows is not None:
        (tmp_path / "train.jsonl").write_text(rows)
    out = CliRunner().invoke(cli.main, ["run", "-c", str(tmp_path / "lightning.toml")])
    assert out.exit_code == 2, out.output
    assert message in out.output and out.output.startswith("error: ")
    assert out.output.strip().count("\n") == 0, out.output  # one line
    assert not (tmp_path / "run").exists()


def test_bad_data_on_resume_leaves_the_existing_run_untouched(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "store.sqlite").write_bytes(b"previous run")
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    (tmp_path / "lightning.toml").write_text(config())
    (tmp_path / "train.jsonl").write_text('{"question": "q"}\n')
    out = CliRunner().invoke(cli.main, ["run", "--resume", "-c", str(tmp_path / "lightning.toml")])
    assert out.exit_code == 2 and "row 1: no field 'answer'" in out.output
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    assert (run / "store.sqlite").read_bytes() == b"previous run"
