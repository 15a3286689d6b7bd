"""lightning.toml validation: the shipped default parses; each broken key is named."""

from pathlib import Path

import pytest

from lightning_sdk import config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    p = tmp_path / "lightning.toml"
    p.write_text(text)
    return p


BASE = """
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
"""


def test_default_config_parses_and_paths_are_relative_to_the_file():
    cfg = config.load(ROOT / "lightning.toml")
    assert cfg.model.name == "builtin:tiny-arith"
    assert cfg.data.train == ROOT / "cookbook/arith/data/train.jsonl" and cfg.data.train.exists()
    assert Path(cfg.agent.module).exists()
    assert cfg.run.dir == ROOT / "runs/arith"


def test_minimal_config_gets_defaults(tmp_path):
    cfg = config.load(write(tmp_path, BASE))
    assert cfg.serve.host == "127.0.0.1" and cfg.train.loss_norm == "rollout" and cfg.data.group_size == 8


@pytest.mark.parametrize("extra, message", [
    ("[train]\nlearning_rate = 1e-3\n", "train.learning_rate: unknown key"),
    ("[train]\nlr = 'fast'\n", "train.lr:"),
    ("[train]\nlr = -1.0\n", "train.lr:"),
    ("[data2]\nx = 1\n", "data2: unknown key"),
    ("[serve]\nbackend = 'tpu'\n", "serve.backend:"),
    ("[run]\niterations = 0\n", "run.iterations:"),
    ("[train]\ntarget_modules = []\n", "train.target_modules:"),
])
def test_bad_key_is_named(tmp_path, extra, message):
    with pytest.raises(config.ConfigError, match=message.replace(".", r"\.")):
        config.load(write(tmp_path, BASE + extra))


def test_group_size_below_two_is_rejected(tmp_path):
    text = BASE.replace('train = "train.jsonl"', 'train = "train.jsonl"\ngroup_size = 1')
    with pytest.raises(config.ConfigError, match=r"data\.group_size"):
        config.load(write(tmp_path, text))


def test_missing_required_and_bad_toml(tmp_path):
    with pytest.raises(config.ConfigError, match="agent: required key is missing"):
        config.load(write(tmp_path, '[data]\ntrain = "x.jsonl"\n'))
    with pytest.raises(config.ConfigError, match="not valid TOML"):
        config.load(write(tmp_path, "[agent\n"))
    with pytest.raises(config.ConfigError, match="cannot read"):
        config.load(tmp_path / "nope.toml")


def test_the_effective_config_a_run_records_holds_every_default_and_hides_the_api_key(tmp_path):
    cfg = config.load(write(tmp_path, BASE + '[serve]\napi_key = "sk-secret-123"\n[train]\nlr = 1e-3\n'))
    out = config.effective(cfg)
    assert out["train"]["lr"] == 1e-3 and out["train"]["clip_eps"] == cfg.train.clip_eps  # set, and a default
    assert out["rollout"]["credit"] == "lightning_rl" and "sk-secret-123" not in str(out)
    assert out["serve"]["api_key"] == "(set, not shown)"
