"""File-system plumbing shared by every layer: directories and files that appear only complete, loading a .py file."""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


@contextmanager
def atomic_dir(path: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """Write into a hidden temp dir beside `path`, then rename it into place: a kill mid-write leaves no `path`.

    With `replace`, an existing `path` is swapped out (and deleted) only after the new one is complete; without
    it, an existing `path` wins and what was written is dropped (several processes building the same thing).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        yield tmp
        old = None
        if path.exists():
            if not replace:
                return
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            path.rename(old / path.name)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_once(target: Path, make: Callable[[Path], object], announce: Callable[[], None]) -> bool:
    """`target` made once by `make(tmp)` into an atomic_dir, whatever other processes ask for it at the same time (a
    lock beside it): True when this call built it. A target without config.json (a broken copy) is made anew;
    `announce` runs first, as a build can take minutes."""
    import fcntl

    if (target / "config.json").exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return False
        announce()
        with atomic_dir(target) as tmp:
            make(tmp)
    return True


def clean_atomic_leftovers(parent: str | Path) -> int:
    """Remove what `atomic_dir` calls killed mid-write left in `parent`; returns how many were removed.

    A `.NAME.tmp-*` directory is a write that never finished: dropped. A `.NAME.old-*` holds the previous `NAME`
    during a swap: if the kill came before the new one was renamed in, it is put back, else it is dropped.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return 0
    removed = 0
    for leftover in sorted(parent.glob(".*.old-*")) + sorted(parent.glob(".*.tmp-*")):
        if not leftover.is_dir():
            continue
        name = leftover.name[1:].rsplit(".old-", 1)[0] if ".old-" in leftover.name else None
        if name is not None and (leftover / name).exists() and not (parent / name).exists():
            (leftover / name).rename(parent / name)
        shutil.rmtree(leftover, ignore_errors=True)
        removed += 1
    return removed


class DirBusyError(RuntimeError):
    """Another process holds the directory's lock."""


@contextmanager
def locked_dir(path: str | Path, lock_name: str = ".lock") -> Iterator[Path]:
    """Hold an exclusive lock (fcntl.flock on `path/lock_name`, created with `path`) while inside.

    The OS drops the lock when the process dies (kill -9 included), so a stale lock file never blocks anyone.
    Raises DirBusyError, naming the holder's pid, when another process holds it. On leaving, the lock file is
    removed while still locked; a process that opened it just before then finds, once it holds the lock, that the
    file it locked is no longer the one at the path, and tries again on the new one: two never hold it at once.
    """
    import fcntl

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lock = path / lock_name
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DirBusyError(f"{path} is in use by another process (pid {holder})") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # removed by its holder meanwhile: lock the file now at the path
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        try:
            lock.unlink(missing_ok=True)  # while still held: see above
        finally:
            os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace the file at `path` with `text` in one rename: readers see the old file or the new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass
class NewFile:
    """A file being written as `tmp`; `path` is where it appeared (set once the `new_file` block completed)."""

    tmp: Path
    path: Path | None = None


@contextmanager
def new_file(folder: str | Path, stem: str, suffix: str) -> Iterator[NewFile]:
    """Write a new file under a hidden temporary name in `folder`; when the block completes it appears as
    `stem + suffix` (or `stem-2 + suffix`, ...: it never replaces a file), in one hard link. A block that raises,
    or a process killed in it, leaves no file of that name. The temp's SQLite -wal/-shm companions go too."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, prefix=f".{stem}{suffix}.tmp-")
    os.close(fd)
    out = NewFile(Path(name))
    try:
        yield out
        for k in itertools.count(1):
            path = folder / f"{stem}{'' if k == 1 else f'-{k}'}{suffix}"
            try:
                os.link(out.tmp, path)  # fails if `path` exists, where a rename would replace it
            except FileExistsError:
                continue
            out.path = path
            break
    finally:
        for leftover in (out.tmp, Path(f"{out.tmp}-wal"), Path(f"{out.tmp}-shm")):
            leftover.unlink(missing_ok=True)


def load_py_file(path: str | Path, module_name: str | None = None, *, importable_siblings: bool = False) -> ModuleType:
    """Execute a .py file as a module (registered in sys.modules under `module_name`, so pickling and dataclasses
    work). `importable_siblings` puts its folder on sys.path, so the file can import the modules beside it."""
    path = Path(path)
    name = module_name or f"lightning_file_{path.stem}"
    if importable_siblings and str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod
