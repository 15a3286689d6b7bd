"""The README's commands are what CI runs and what the default run needs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_word_for_word():
    ci = (ROOT / ".ci/run").read_text().splitlines()
    readme = (ROOT / "README.md").read_text()
    test_command = ci[ci.index("# README test command (tests/test_readme.py keeps the two identical):") + 1]
    assert "pytest" in test_command and f"\n{test_command}\n" in readme


def test_readme_demo_command_runs_the_default_config():
    readme = (ROOT / "README.md").read_text()
    demo = next(line for line in readme.splitlines() if line.endswith("lightning run"))
    assert "pip install torch==2.13.0" in demo and (ROOT / "lightning.toml").exists()
