"""Datasets of tasks: local jsonl or parquet files, one task (a JSON object) per row."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


class DatasetError(ValueError):
    pass


def load(path: str | Path, required_fields: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """The rows of a dataset; `required_fields` (data.required_fields) must be in every row."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path}: file not found")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"dataset {path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"dataset {path}, line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"dataset {path}, line {n}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    else:
        raise DatasetError(f"dataset {path}: expected a .jsonl or .parquet file")
    if not rows:
        raise DatasetError(f"dataset {path}: no tasks")
    for n, row in enumerate(rows, 1):
        missing = [f for f in required_fields if f not in row]
        if missing:
            raise DatasetError(f"dataset {path}, row {n}: no field {missing[0]!r} (data.required_fields = "
                               f"{list(required_fields)}; the row has {sorted(row)})")
    return rows


def task_id(task: dict) -> str:
    """A stable id from the task's content (an explicit `id` field wins), so resume and the store agree."""
    if "id" in task:
        return str(task["id"])
    return hashlib.sha1(json.dumps(task, sort_keys=True, default=str).encode()).hexdigest()[:12]
