"""What a person meets around a run: the top-level help whole, every option explained, `--set` overrides validated
like the file, "did you mean" for a mistyped key, and a clean exit that leaves one store file and no lock (and
readers that write nothing beside it)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from lightning_sdk import cli, config
from lightning_sdk.files import DirBusyError, locked_dir
from lightning_sdk.runtime import Runtime
from tests.test_runtime_faults import make_project, task

ROOT = Path(__file__).resolve().parents[1]


def lightning(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_sdk.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"})


def test_the_top_level_help_is_whole_and_every_option_has_help():
    out = lightning("--help").stdout
    assert "..." not in out.split("Commands:")[1], out  # no command's line cut short
    assert "Run the agent once (nothing trained) and say whether it would train, and if not why." in " ".join(
        out.split())
    for command in cli.main.commands.values():
        for param in command.params:
            if isinstance(param, cli.click.Option):
                assert param.help, f"{command.name} {param.opts} has no help"


def test_an_unknown_key_gets_did_you_mean(tmp_path):
    with pytest.raises(config.ConfigError, match=r"train.lrr: unknown key; did you mean train.lr\?"):
        config.parse({"data": {"train": "x"}, "train": {"lrr": 1e-3}})
    with pytest.raises(config.ConfigError, match=r"policies.a.lora_rr: unknown key; did you mean "
                                                 r"policies.a.lora_r\?"):
        config.parse({"data": {"train": "x"}, "policies": {"a": {"components": ["x"], "lora_rr": 2}}})
    with pytest.raises(config.ConfigError) as far:
        config.parse({"data": {"train": "x"}, "train": {"zzz": 1}})
    assert str(far.value) == "train.zzz: unknown key"  # nothing close: no guess


def test_set_overrides_config_keys_validated_like_the_file(tmp_path):
    make_project(tmp_path, [task(1, 2)] * 4)
    toml = tmp_path / "lightning.toml"
    cfg = cli._load(toml, ("train.lr=1e-4", "rollout.components=[\"solver\"]", "run.name=exp2"))
    assert cfg.train.lr == 1e-4 and cfg.rollout.components == ["solver"] and cfg.run.name == "exp2"
    with pytest.raises(config.ConfigError, match=r"--set: train.lrr: unknown key; did you mean train.lr\?"):
        cli._load(toml, ("train.lrr=1e-4",))
    for bad, expected in (("data.group_size=1", "data.group_size"), ("train.lr", "expected KEY=VALUE")):
        for command in ("run", "check", "eval"):
            out = lightning(command, "--set", bad, cwd=tmp_path)
            assert out.returncode == 2 and expected in out.stdout and len(out.stdout.strip().splitlines()) == 1, \
                (command, out.stdout, out.stderr)
    assert not (tmp_path / "run").exists()


def test_the_run_lock_is_exclusive_and_removed_when_released(tmp_path):
    with locked_dir(tmp_path / "d", ".lock"):
        assert (tmp_path / "d/.lock").exists()
        with pytest.raises(DirBusyError, match=f"pid {os.getpid()}"):
            with locked_dir(tmp_path / "d", ".lock"):
                pass
    assert not (tmp_path / "d/.lock").exists()
    with locked_dir(tmp_path / "d", ".lock"):  # free again
        pass


def test_a_clean_exit_leaves_one_store_file_and_readers_write_nothing_beside_it(tmp_path):
    cfg = make_project(tmp_path, [task(a, 2) for a in range(1, 5)], run='name = "clean"\ndir = "run"\niterations = 1')
    Runtime(cfg, console=Console(file=io.StringIO())).run()
    run = tmp_path / "run"
    assert (run / "store.sqlite").is_file()
    assert not [p.name for p in run.iterdir() if p.name.startswith("store.sqlite-") or p.name == ".lock"]
    before = sorted(p.name for p in run.iterdir())
    out = lightning("traces", "--run-dir", str(run))
    words = " ".join(out.stdout.split())  # a long tmp path wraps the header
    assert out.returncode == 0 and "16 rollouts" in words, out.stdout + out.stderr
    assert sorted(p.name for p in run.iterdir()) == before  # no -shm, no -wal


def test_piped_output_has_no_blank_lines_and_a_notebook_without_ipywidgets_no_warnings():
    import warnings

    from lightning_sdk.console import status
    from lightning_sdk.rollouts.collector import progress_bar

    piped = Console(file=io.StringIO(), width=200)
    for n in (1, 2):
        with progress_bar(piped, "collect", 3) as advance:
            advance()
        with status(piped, "update"):
            pass
        piped.print(f"iteration {n}: reward 0.5")
    assert piped.file.getvalue() == "iteration 1: reward 0.5\niteration 2: reward 0.5\n"
    notebook = Console(file=io.StringIO(), force_jupyter=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with progress_bar(notebook, "collect", 3) as advance:
            advance()
        with status(notebook, "update"):
            pass
    assert not [str(w.message) for w in seen if "ipywidgets" in str(w.message)]


def test_a_notebooks_already_imported_hf_libraries_get_their_progress_bars_off():
    code = ("import huggingface_hub.utils as h, transformers.utils.logging as t\n"
            "assert not h.are_progress_bars_disabled() and t.is_progress_bar_enabled()\n"
            "from lightning_sdk.console import configure_output\nconfigure_output()\n"
            "print(h.are_progress_bars_disabled(), t.is_progress_bar_enabled())\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_the_iteration_table_is_printed_uncut_where_output_is_no_terminal():
    from lightning_sdk.console import print_whole
    from lightning_sdk.summary import iteration_table

    policy = "a-long-run-name-" * 8 + "iter1"
    row = {"iteration": 1, "policy": policy, "reward_mean": 0.5, "reward_std": 0.1, "failed": 0, "transitions": 8,
           "collect_s": 1.0, "update_s": 1.0}
    log = Console(file=io.StringIO(), width=120)
    print_whole(log, iteration_table("run", [row], None, None, beta=0.0))
    assert policy in log.file.getvalue()


def test_a_pipelined_runs_table_does_not_call_the_gap_a_mismatch_near_0():
    from lightning_sdk.summary import iteration_table

    row = {"iteration": 1, "policy": "p", "reward_mean": 0.5, "reward_std": 0.1, "failed": 0, "transitions": 8,
           "collect_s": 1.0, "update_s": 1.0, "train.logprob_gap": 0.3}
    for pipelined, said in ((False, "(near 0: the trainer scores what the server sampled)"),
                            (True, "it includes how far the policy moved since each call was sampled")):
        out = Console(file=io.StringIO(), width=400)
        out.print(iteration_table("run", [row], None, None, beta=0.0, pipelined=pipelined))
        title = " ".join(out.file.getvalue().split())  # the title wraps at the table's width
        assert said in title
        assert ("near 0: the trainer scores" in title) is not pipelined
