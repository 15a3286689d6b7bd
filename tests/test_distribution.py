"""The distribution's own name, and the one line when Lightning AI's `lightning-sdk` shares the environment."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from lightning_sdk.distribution import DISTRIBUTION, OTHER, VERSION

ROOT = Path(__file__).resolve().parents[1]


def _fake_other(site: Path) -> None:
    """What the Studios SDK's wheel leaves: a lightning_sdk dist-info whose RECORD lists files in lightning_sdk/."""
    info = site / "lightning_sdk-2026.10.13.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning-sdk\nVersion: 2026.10.13\n")
    (info / "RECORD").write_text("lightning_sdk/__init__.py,,\nlightning_sdk/cli/__init__.py,,\n"
                                 "lightning_sdk-2026.10.13.dist-info/RECORD,,\n")


def _python(*args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(([str(site)] if site else []) + [str(ROOT)])
    return subprocess.run([sys.executable, *args], env={**os.environ, "PYTHONPATH": path}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_pyproject_names_the_distribution_and_its_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == DISTRIBUTION != OTHER
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_sdk.distribution.VERSION"}
    assert VERSION == __import__("lightning_sdk").__version__


def test_import_and_command_name_the_other_distribution_in_one_line(tmp_path):
    _fake_other(tmp_path)
    for args in (["-c", "import lightning_sdk"], ["-m", "lightning_sdk.cli", "--version"]):
        out = _python(*args, site=tmp_path)
        assert out.returncode == 0, out.stderr
        lines = [line for line in out.stderr.splitlines() if "lightning-sdk 2026.10.13" in line]
        assert len(lines) == 1 and "cannot share an environment" in lines[0] and "pip uninstall lightning-sdk" in lines[0]


def test_no_line_without_it():
    # This environment may hold an editable install of this project under its old name: a .pth, no lightning_sdk/ files.
    out = _python("-c", "import lightning_sdk")
    assert out.returncode == 0 and OTHER not in out.stderr, out.stderr


def test_install_hints_name_this_distribution():
    old = "pip install 'lightning" + "-sdk"  # split, so this file is not a hit itself
    hints = subprocess.run(["git", "grep", "-n", old], cwd=ROOT, capture_output=True, text=True)
    assert hints.returncode == 1 and hints.stdout == ""  # 1: no match
    assert f"pip install '{DISTRIBUTION}[gpu]'" in (ROOT / "lightning_sdk/servers/select.py").read_text()
