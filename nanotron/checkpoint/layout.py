"""The on-disk layout of a checkpoint folder, and the only code that changes it.

    step-N/            committed checkpoint: DCP shards + .metadata, config.toml, tokenizer/, trainer_state.json,
                       checksums.json (the manifest: every other file and its checksum)
    step-N.tmp/        a save in progress (or killed mid-way): never loaded, removed at the next start
    step-N.deleting/   an old checkpoint being removed: never loaded
    latest             names the newest committed step dir; replaced atomically

A step dir counts as committed once it is renamed from step-N.tmp with its trainer_state.json, which is written
after every rank's files, followed by checksums.json, the manifest of every file; so a process killed at any
moment leaves either the previous checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from nanotron.errors import CheckpointError
from nanotron.io import fsync_dir, write_atomic

STEP_DIR = re.compile(r"^step-(\d+)$")
COMMIT_FILE = "trainer_state.json"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def is_committed(path: Path) -> bool:
    return bool(STEP_DIR.match(path.name)) and (path / COMMIT_FILE).is_file()


def committed_steps(folder: Path) -> list[Path]:
    """Committed step dirs, oldest first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if is_committed(p)), key=step_of)


def latest_checkpoint(folder: Path) -> Path | None:
    """The `latest` pointer if it names a committed dir, else the newest committed dir."""
    pointer = folder / "latest"
    if pointer.is_file():
        target = folder / pointer.read_text(errors="replace").strip()
        if STEP_DIR.match(target.name) and is_committed(target):
            return target
    steps = committed_steps(folder)
    return steps[-1] if steps else None


def find_checkpoint(path: Path) -> Path:
    """A step-N dir (or any DCP dir, e.g. a from-hf import) as given, or the latest one in a checkpoint/run dir."""
    if (path / ".metadata").is_file():
        return path
    for folder in (path, path / "checkpoints"):
        found = latest_checkpoint(folder)
        if found is not None:
            return found
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    raise CheckpointError(
        f"'{path}' holds no committed checkpoint (expected a step-N dir with .metadata, "
        "or a checkpoint/run dir containing one)"
    )


def clean_stale(folder: Path) -> None:
    """Removes saves that were killed mid-way (step-N.tmp) or mid-removal (step-N.deleting)."""
    if folder.is_dir():
        for stale in [*folder.glob("step-*.tmp"), *folder.glob("step-*.deleting")]:
            shutil.rmtree(stale, ignore_errors=True)


def commit(tmp: Path, target: Path, progress: dict, write_manifest: Callable[[Path], None]) -> None:
    """Writes the commit marker, then the manifest of every file (the marker's too: `integrity.write`, passed in so
    that readers of the layout, such as the watcher, load no torch), renames step-N.tmp to step-N and points
    `latest` at it."""
    write_atomic(tmp / COMMIT_FILE, json.dumps(progress, indent=1))
    write_manifest(tmp)
    publish(tmp, target)
    write_atomic(target.parent / "latest", target.name + "\n")


def publish(tmp: Path, target: Path) -> None:
    """Renames the finished dir `tmp` to `target`, durably: a process killed at any moment leaves either no
    `target` or the whole of it. A `target` already there (left by an earlier run that went further, then resumed
    from before it; or an empty folder an import was told to fill) is removed first."""
    if target.exists():
        remove(target)
    os.rename(tmp, target)
    fsync_dir(target.parent)


def remove(path: Path) -> None:
    """Renames first, then deletes: a removal killed half-way leaves a `.deleting` dir nothing will load."""
    doomed = path.with_name(path.name + ".deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(folder: Path, newest: int, keep: int) -> None:
    """Keeps the newest `keep` checkpoints up to step `newest` (0 keeps all); later ones (an abandoned
    branch of a run resumed from further back) stay."""
    if keep:
        older = [p for p in committed_steps(folder) if step_of(p) <= newest]
        for old in older[:-keep]:
            remove(old)
