"""Crash-safe file writes: a reader sees the old file or the new one, never half of one. And outputs checked before
the work that fills them: a path that can't be written fails at once, not after the work."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from nanotron.errors import StorageError


def check_writable(key: str, folder: Path) -> None:
    """Fails before any work (before any process group exists) if `folder`, named by `key` (a config key or a
    flag), can't be made or written: one line with the reason, exit 2."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = "a file is there" if folder.is_file() else error.strerror
        raise StorageError(f"{key}: cannot write to '{folder}' ({reason}); choose a writable folder") from None


def check_writable_file(key: str, path: Path) -> None:
    """As `check_writable`, for the file `path` that the work ends by writing."""
    if path.is_dir():
        raise StorageError(f"{key}: '{path}' is a folder; give the path of a file to write")
    check_writable(key, path.parent)


def check_new_folder(out: Path, key: str = "") -> None:
    """Refuses a folder output that exists and holds anything, or is a file: its files are not the command's to
    replace (a tokenizer that tokenized data was built with, an export)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        prefix = f"{key}: " if key else ""
        raise StorageError(f"{prefix}output '{out}' already exists and is not an empty folder; choose a new path")


def check_not_input(key: str, out: Path, inputs: Iterable[Path]) -> None:
    """Refuses an output that would replace one of the command's inputs, the same file (by any name or link), or
    lie inside an input folder, whether it exists yet or not (a checkpoint's manifest would not list it, a corpus
    folder would be read with it). Every command with outputs calls it first, before it makes any folder."""
    for source in inputs:
        if out.exists() and source.exists() and os.path.samefile(out, source):
            raise StorageError(f"{key}: '{out}' is also an input; choose a new path")
        if source.is_dir() and source.resolve() in out.resolve().parents:
            raise StorageError(f"{key}: '{out}' lies inside the input '{source}'; choose a path outside it")


def write_atomic(path: Path, content: str | bytes, durable: bool = True) -> None:
    """Writes `content` to a temporary sibling, then renames it over `path`.

    `durable` also fsyncs the file and its folder, so the new content survives a power loss, not only a
    killed process (what commit markers and `latest` need).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    data = content.encode() if isinstance(content, str) else content
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
