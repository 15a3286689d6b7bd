"""Datasets of tasks: local jsonl or parquet files, one task (a JSON object) per row."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


class DatasetError(ValueError):
    pass


def load(path: str | Path, required_fields: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """The rows of a dataset; `required_fields` (data.required_fields) must be in every row."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path}: file not found")
    if not path.is_file():
        raise DatasetError(f"dataset {path}: is a directory (or not a regular file); expected a .jsonl or .parquet "
                           f"file")
    if path.suffix == ".parquet":
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
        raise DatasetError(f"dataset {path}: expected a .jsonl or .parquet file")
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


def task_id(task: dict) -> str:
    """A stable id from the task's content (an explicit `id` field wins), so resume and the store agree."""
    if "id" in task:
        return str(task["id"])
    return hashlib.sha1(json.dumps(task, sort_keys=True, default=str).encode()).hexdigest()[:12]
