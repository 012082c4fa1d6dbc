"""Crash-safe file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


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
