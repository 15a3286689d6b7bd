"""Datasets of tasks: local jsonl or parquet files, one task (a JSON object) per row; and what Hugging Face
`datasets` reads locally (a save_to_disk directory, csv, a JSON array), with the `datasets` extra."""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

# Read through Hugging Face `datasets` (imported only for these: it costs seconds to import): a directory that
# `save_to_disk` wrote, and the file formats below (a .json file only when it holds one JSON array).
DATASETS_BUILDERS = {".csv": "csv", ".json": "json"}


class DatasetError(ValueError):
    pass


def load(path: str | Path, required_fields: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """The rows of a dataset; `required_fields` (data.required_fields) must be in every row."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path}: file not found")
    if path.is_dir() or path.suffix == ".csv" or (path.suffix == ".json" and _is_json_array(path)):
        rows = _hf_rows(path)
    elif not path.is_file():
        raise DatasetError(f"dataset {path}: not a regular file; expected a .jsonl or .parquet file, a .csv or .json "
                           f"array, or a `datasets` save_to_disk directory")
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"dataset {path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DatasetError(f"dataset {path}: cannot read ({e.strerror})") from None
        for n, data in enumerate(raw.splitlines(), 1):
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"dataset {path}, line {n}: not UTF-8 (byte {data[e.start]:#04x} at column "
                                   f"{e.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"dataset {path}, line {n}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise DatasetError(f"dataset {path}, line {n}: nested too deeply to read (more than Python's "
                                   f"recursion limit of {sys.getrecursionlimit()} levels)") from None
            if not isinstance(row, dict):
                raise DatasetError(f"dataset {path}, line {n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    else:
        raise DatasetError(f"dataset {path}: expected a .jsonl, .parquet or .csv file, or a datasets save_to_disk "
                           f"directory")
    if not rows:
        raise DatasetError(f"dataset {path}: no tasks")
    seen: dict[str, int] = {}
    for n, row in enumerate(rows, 1):
        missing = [f for f in required_fields if f not in row]
        if missing:
            raise DatasetError(f"dataset {path}, row {n}: no field {missing[0]!r} (data.required_fields = "
                               f"{list(required_fields)}; the row has {sorted(row)})")
        try:
            tid = task_id(row)
        except (ValueError, RecursionError):  # json.dumps of a row nested deeper than the recursion limit
            raise DatasetError(f"dataset {path}, row {n}: nested too deeply to store") from None
        first = seen.setdefault(tid, n)
        if first != n and rows[first - 1] != row:  # the store keeps one task per id: the other would be lost
            ids = f"id {rows[first - 1].get('id')!r} and id {row.get('id')!r}" if "id" in row else "the same content hash"
            raise DatasetError(f"dataset {path}, rows {first} and {n}: both get task id {tid!r} ({ids}); give "
                               f"every task a unique id")
    return rows


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def _hf_rows(path: Path) -> list[dict]:
    """The rows of a dataset that Hugging Face `datasets` reads: a save_to_disk directory, csv, a JSON array."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"dataset {path}: reading it needs Hugging Face datasets "
                           f"(pip install 'lightning-agent-rl[datasets]')") from None
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise DatasetError(f"dataset {path}: a directory, but not one that datasets' save_to_disk wrote; "
                               f"expected a dataset directory, or a .jsonl/.parquet/.csv file") from None
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1:
                raise DatasetError(f"dataset {path}: holds the splits {sorted(ds)}; name one, e.g. "
                                   f"{path / sorted(ds)[0]}")
            (ds,) = ds.values()
        return ds.to_list()
    # load_dataset caches an Arrow copy: a throwaway cache, so reading a file writes nothing that stays.
    with tempfile.TemporaryDirectory(prefix="lightning-data-") as cache:
        try:
            ds = datasets.load_dataset(DATASETS_BUILDERS[path.suffix], data_files=str(path), split="train",
                                       cache_dir=cache)
        except Exception as e:  # noqa: BLE001 - datasets raises its own error types per builder; name the file
            raise DatasetError(f"dataset {path}: datasets cannot read it ({type(e).__name__}: {e})") from None
        return ds.to_list()


def task_id(task: dict) -> str:
    """A stable id from the task's content (an explicit `id` field wins), so resume and the store agree."""
    if "id" in task:
        return str(task["id"])
    return hashlib.sha1(json.dumps(task, sort_keys=True, default=str).encode()).hexdigest()[:12]
