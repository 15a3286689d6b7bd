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
    "GPUs that are not there": (config(serve='device = "cuda"', devices="serve = [0]"), GOOD_ROWS,
                                "devices.serve = [0]: no CUDA GPU is visible"),
    "GPUs half shared": (config(devices="serve = [0, 1]\ntrain = [1, 2]"), GOOD_ROWS,
                         "devices: serve = [0, 1] and train = [1, 2] share GPU(s) [1]"),
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


# ------------------------------------------------------------- issue 18: 26 more inputs, each one line, exit 2

def _tree(root: Path) -> set[Path]:
    # Python's own bytecode cache of the user's agent module is the one thing an import may leave behind.
    return {p for p in root.rglob("*") if "__pycache__" not in p.parts}


def _invoke(tmp_path: Path, toml: str, rows: str | None = GOOD_ROWS, agent: str | None = None):
    (tmp_path / "lightning.toml").write_text(toml)
    if rows is not None:
        (tmp_path / "train.jsonl").write_text(rows)
    if agent is not None:
        (tmp_path / "agent.py").write_text(agent)
    before = _tree(tmp_path)
    out = CliRunner().invoke(cli.main, ["run", "-c", str(tmp_path / "lightning.toml")])
    assert out.exit_code == 2, out.output
    assert out.output.startswith("error: "), out.output
    assert _tree(tmp_path) == before, "something was written"  # no run directory, no store, nothing
    return out


LOCAL_AGENT = config(agent='module = "agent.py"')
ROLLOUT_OK = "@ls.rollout\ndef solve(task, llm):\n    return ''\n"
REWARD_OK = "@ls.reward\ndef score(task, output):\n    return 0.0\n"
AGENT_CASES = {  # the user's own code fails: one line, then its traceback
    "syntax error": ("import lightning_sdk as ls\ndef solve(task, llm:\n    pass\n", "importing it raised SyntaxError"),
    "import error": ("import lightning_sdk as ls\nimport no_such_package_xyz\n",
                     "importing it raised ModuleNotFoundError: No module named 'no_such_package_xyz'"),
    "exception at import": ("import lightning_sdk as ls\nraise RuntimeError('boom at import')\n",
                            "importing it raised RuntimeError: boom at import"),
    "sys.exit(0) at import": ("import sys\nsys.exit(0)\n", "importing it exited (SystemExit)"),
    "rollout of 3 arguments": ("import lightning_sdk as ls\n@ls.rollout\ndef solve(task, llm, extra):\n    return ''\n"
                               + REWARD_OK, "@rollout solve(task, llm, extra): expected fn(task) or fn(task, llm)"),
    "reward of 3 arguments": ("import lightning_sdk as ls\n" + ROLLOUT_OK +
                              "@ls.reward\ndef score(task, output, extra):\n    return 0.0\n",
                              "@reward score(task, output, extra): expected fn(task, output)"),
}


@pytest.mark.parametrize("case", list(AGENT_CASES))
def test_an_agent_module_that_fails_to_import_is_one_line_then_its_traceback(tmp_path, case):
    source, message = AGENT_CASES[case]
    out = _invoke(tmp_path, LOCAL_AGENT, agent=source)
    first, *rest = out.output.splitlines()
    assert first.startswith("error: agent.module = ") and message in first, out.output
    assert str(tmp_path / "agent.py") in "\n".join(rest), out.output  # the user's traceback, their file and line
    assert "importlib" not in out.output and "lightning_sdk/agent.py" not in out.output  # not our frames


def _one_line(tmp_path: Path, message: str, toml: str, rows: str | None = GOOD_ROWS) -> None:
    out = _invoke(tmp_path, toml, rows)
    assert message in out.output and out.output.strip().count("\n") == 0, out.output


MORE_CASES = {
    "missing dotted module": (config(agent='module = "no_such_pkg.agent_mod"'), GOOD_ROWS,
                              "agent.module = 'no_such_pkg.agent_mod': no module named 'no_such_pkg'"),
    "empty module": (config(agent='module = ""'), GOOD_ROWS, "agent.module = '': expected a .py path"),
    "bogus credit": (config(rollout='credit = "bogus"'), GOOD_ROWS, "rollout.credit = 'bogus': expected one of"),
    "non-UTF-8 dataset": (config(), None, "train.jsonl, line 2: not UTF-8 (byte 0xff"),
    "dataset is a directory": (config(), None, "train.jsonl: a directory"),
    "row nested 200k deep": (config(), None, "train.jsonl, line 3: nested too deeply"),
    "ids 1 and '1'": (config(data='train = "train.jsonl"'), '{"id": 1, "q": "a"}\n{"id": "1", "q": "b"}\n',
                      "rows 1 and 2: both get task id '1' (id 1 and id '1')"),
    "run.name with a dot": (config(run='dir = "run"\nname = "exp.v2"'), GOOD_ROWS, "run.name: expected 1-64 letters"),
    "hub id that is nowhere": (config(model='name = "nobody/no-such-model"'), GOOD_ROWS,
                               "model 'nobody/no-such-model': "),
    "model path that is not there": (config(model='name = "/no/such/model"'), GOOD_ROWS,
                                     "model '/no/such/model': no such directory"),
    "bogus device": (config(train='device = "bogus"'), GOOD_ROWS, "train.device: expected 'auto', 'cpu'"),
    "host 256.1.1.1": (config(serve='host = "256.1.1.1"'), GOOD_ROWS, "serve.host: expected an IP address"),
    "bogus serve device": (config(serve='device = "gpu"'), GOOD_ROWS, "serve.device: expected 'cpu', 'cuda'"),
    "serve device cuda without a GPU": (config(serve='device = "cuda"'), GOOD_ROWS,
                                        "serve.device = 'cuda': no CUDA GPU is visible to torch; use 'cpu'"),
    "run.dir under /proc": (config(run='dir = "/proc/lightning-run"'), GOOD_ROWS, "is on a virtual file system"),
}


@pytest.mark.parametrize("case", list(MORE_CASES))
def test_more_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, case):
    toml, rows, message = MORE_CASES[case]
    if case == "serve device cuda without a GPU":
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here")
    if case == "non-UTF-8 dataset":
        (tmp_path / "train.jsonl").write_bytes(GOOD_ROWS.splitlines()[0].encode() + b'\n{"question": "\xff"}\n')
    elif case == "dataset is a directory":
        (tmp_path / "train.jsonl").mkdir()
    elif case == "row nested 200k deep":
        (tmp_path / "train.jsonl").write_text(GOOD_ROWS + '{"q": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    _one_line(tmp_path, message, toml, rows)
    if case == "hub id that is nowhere":  # fast, without a minute of hub retries, and says what to do instead
        out = CliRunner().invoke(cli.main, ["run", "-c", str(tmp_path / "lightning.toml")])
        assert "set model.name to its directory" in out.output


def test_run_dir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    _one_line(tmp_path, "run.dir = ", config(run='dir = "taken"'))
    assert (tmp_path / "taken").read_text() == "not a directory"


def test_a_busy_port(tmp_path):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        _one_line(tmp_path, f"serve.port = {port}: cannot listen on 127.0.0.1:{port}",
                  config(serve=f"port = {port}"))


def test_vllm_backend_without_vllm_leaves_no_store(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    _one_line(tmp_path, "serve.backend = 'vllm': the vllm package is not installed", config(serve='backend = "vllm"'))


def _mount_tmpfs(where: Path, options: str) -> None:
    import subprocess

    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:  # needs root (CAP_SYS_ADMIN); chmod alone does not stop root from writing
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_run_dir_on_a_read_only_or_full_file_system(tmp_path, kind):
    """Real file systems: a tmpfs mounted read-only, and a 1 MiB tmpfs filled to the last byte."""
    import subprocess

    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "ro,size=1m" if kind == "read-only" else "size=1m")
    try:
        if kind == "full":
            with (mnt / "filler").open("wb") as f, pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        before = sorted(mnt.iterdir())
        message = "is read-only" if kind == "read-only" else "MiB free on its disk"
        _one_line(tmp_path, message, config(run=f'dir = "{mnt}/run"'))
        assert sorted(mnt.iterdir()) == before
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
