"""data.train / data.eval read what Hugging Face `datasets` reads locally, on datasets this test writes."""

import json

import pytest

datasets = pytest.importorskip("datasets")  # the `datasets` extra (in `dev`, so CI has it)

from lightning_sdk import data  # noqa: E402
from lightning_sdk.data import DatasetError  # noqa: E402

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 0)]]


def test_save_to_disk_directory(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert data.load(tmp_path / "ds", ["question", "answer"]) == ROWS


def test_dataset_dict_needs_a_split_named(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"holds the splits \['test', 'train'\]; name one, e.g. .*dd/test$"):
        data.load(tmp_path / "dd")
    assert data.load(tmp_path / "dd" / "train") == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "one"))
    assert data.load(tmp_path / "one") == ROWS  # one split: that one


def test_csv_and_json_array_through_datasets(tmp_path):
    (tmp_path / "t.csv").write_text("question,answer\n" + "".join(f'"{r["question"]}",{r["answer"]}\n' for r in ROWS))
    rows = data.load(tmp_path / "t.csv", ["question", "answer"])
    assert [r["question"] for r in rows] == [r["question"] for r in ROWS]
    assert [str(r["answer"]) for r in rows] == [r["answer"] for r in ROWS]  # csv types its columns: 3 is an int
    (tmp_path / "t.json").write_text(json.dumps(ROWS))
    assert data.load(tmp_path / "t.json") == ROWS
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert data.load(tmp_path / "lines.json") == ROWS  # JSON lines in a .json file: still the jsonl reader


def test_bad_inputs_name_the_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: a directory, but not one that datasets' save_to_disk wrote"):
        data.load(tmp_path / "empty")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DatasetError, match=r"ds, row 1: no field 'prompt'"):
        data.load(tmp_path / "ds", ["prompt"])


def test_a_run_config_takes_a_dataset_directory(tmp_path):
    from lightning_sdk import config

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "train"))
    (tmp_path / "lightning.toml").write_text('[agent]\nmodule = "a.py"\n[data]\ntrain = "train"\neval = "train"\n')
    cfg = config.load(tmp_path / "lightning.toml")
    assert data.load(cfg.data.train) == ROWS and cfg.data.eval == tmp_path / "train"
