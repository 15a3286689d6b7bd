"""Model loading on local files (the same path a hub id takes), the builtin model, and dataset loading."""

import json
import shutil
from pathlib import Path

import pytest

from lightning_sdk import data, models
from lightning_sdk.files import load_py_file

ARITH = Path(__file__).parents[1] / "cookbook" / "arith" / "teacher.py"  # builtin:tiny-arith's teacher
arith = load_py_file(ARITH)


def test_builtin_model_is_a_normal_hf_directory(tiny_model_path, tmp_path):
    tok = models.load_tokenizer(tiny_model_path)
    assert len(tok) >= 256 and tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": arith.question(2, 3)}], add_generation_prompt=True)
    text = tok.decode(ids["input_ids"])
    assert text.endswith("<|im_start|>assistant\n") and "What is 2 + 3?" in text
    # Copied elsewhere it loads as a local model directory, exactly like a downloaded checkpoint.
    local = tmp_path / "my-model"
    shutil.copytree(tiny_model_path, local)
    assert models.resolve(str(local)) == str(local.resolve())
    model = models.load_causal_lm(models.resolve(str(local)), dtype="float32")
    assert model.config.vocab_size == len(tok) and not model.config.tie_word_embeddings


def test_builtin_tiny_arith_is_the_repositorys_arith_teacher(tiny_model_path, tmp_path, monkeypatch):
    assert models.resolve(f"tiny:{ARITH}") == tiny_model_path  # the same model, the same cache entry
    monkeypatch.setattr(models, "REPO", tmp_path)  # a wheel install: no cookbook beside the package
    with pytest.raises(models.ModelLoadError, match=r"built from cookbook/arith/teacher.py .* use tiny:<path/to/"):
        models.resolve("builtin:tiny-arith")


def test_bad_model_names_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(models.ModelLoadError, match="unknown builtin model"):
        models.resolve("builtin:gpt-17")
    (tmp_path / "empty").mkdir()
    with pytest.raises(models.ModelLoadError, match="no config.json"):
        models.resolve(str(tmp_path / "empty"))
    # A hub id in the local Hugging Face cache passes through without asking the hub (a real cache layout).
    from huggingface_hub import constants

    repo = tmp_path / "hub/models--Qwen--Qwen2.5-0.5B-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text("abc123")
    (repo / "snapshots/abc123").mkdir(parents=True)
    (repo / "snapshots/abc123/config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert models.resolve("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(models.ModelLoadError, match="no such directory"):
        models.resolve("/no/such/model")
    with pytest.raises(models.ModelLoadError, match="dtype"):
        models.load_causal_lm(str(tmp_path), dtype="float8")


def test_tokenizer_without_chat_template_is_refused(tiny_model_path, tmp_path):
    broken = tmp_path / "no-template"
    shutil.copytree(tiny_model_path, broken)
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(cfg))
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(models.ModelLoadError, match="no chat template"):
        models.load_tokenizer(str(broken))


def test_dataset_loading_and_errors(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"question": "q1", "answer": "1"}\n\n{"id": 7, "question": "q2"}\n')
    rows = data.load(good)
    assert rows[1]["question"] == "q2" and data.task_id(rows[1]) == "7"
    assert data.task_id(rows[0]) == data.task_id(dict(rows[0])) and len(data.task_id(rows[0])) == 12
    with pytest.raises(data.DatasetError, match="file not found"):
        data.load(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(data.DatasetError, match="no tasks"):
        data.load(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(data.DatasetError, match="line 2: not valid JSON"):
        data.load(tmp_path / "bad.jsonl")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(data.DatasetError, match="line 1: expected a JSON object"):
        data.load(tmp_path / "list.jsonl")
