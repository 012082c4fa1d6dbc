"""Reading checkpoint files as untrusted input: no pickle payload can run, a bad file is a one-line error.

DCP's pickled `.metadata` is read with an allow-list unpickler, every non-tensor value with
`torch.load(weights_only=True)`; every shard the index names is checked to exist and be long enough
before anything is read, and a read that fails names its file.
"""

from __future__ import annotations

import errno
import os
import pathlib
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.futures import Future

import nanotron.checkpoint.integrity as integrity
from nanotron.checkpoint.layout import find_checkpoint
from nanotron.checkpoint.torch_private import DCP_INDEX_PRIVATE_GLOBALS, set_element
from nanotron.errors import CheckpointError, file_size_limit, os_reason, short

_DCP_INDEX_CLASSES = "Metadata MetadataIndex StorageMeta TensorProperties TensorStorageMetadata ChunkStorageMetadata"
_ALLOWED_GLOBALS = {f"torch.distributed.checkpoint.metadata.{name}" for name in _DCP_INDEX_CLASSES.split()} | {
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    *DCP_INDEX_PRIVATE_GLOBALS,
    "torch.Size",
    "collections.OrderedDict",
}
# The index holds the checkpoint's path, pickled under its class's module: `pathlib` up to Python 3.12,
# `pathlib._local` from 3.13 on. Either reads as `pathlib`'s class on any Python.
_PATH_MODULES, _PATH_CLASSES = {"pathlib", "pathlib._local"}, {"PosixPath", "WindowsPath"}


# Failures a user can fix: the file system's, and files that are not what a checkpoint holds (corrupt, foreign).
USER_FIXABLE = (OSError, pickle.UnpicklingError, EOFError, UnicodeDecodeError)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata but refuses any class a checkpoint index never contains (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _PATH_MODULES and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if f"{module}.{name}" in _ALLOWED_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}, which a DCP index never holds")


def read_metadata(path: Path) -> Metadata:
    """The DCP index of `path`, read safely, after checking every shard it names is there and long enough."""
    file = path / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"'{file}' is missing: '{path}' is not a complete DCP checkpoint")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"expected a DCP Metadata object, found {type(metadata).__name__}")
    except Exception as error:
        raise CheckpointError(f"'{file}' is corrupt or not a DCP index ({short(error)})") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if Path(name).name != name:
            raise CheckpointError(f"'{file}' names a shard outside its folder ({name!r}); refusing to read it")
        if not shard.is_file():
            raise CheckpointError(f"'{shard}' is missing: the checkpoint '{path}' is incomplete")
        if shard.stat().st_size < size:
            raise CheckpointError(f"'{shard}' is truncated ({shard.stat().st_size} bytes, the index needs {size})")
    return metadata


class _SafeReader(FileSystemReader):
    """FileSystemReader that serves the pre-checked index and names the shard file when a read fails."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self.folder, self.metadata = path, metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(replace(plan, items=items), planner).wait()
            except Exception as error:
                raise CheckpointError(f"'{self.folder / name}' is corrupt ({short(error)})") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor values (optimizer hyper-parameters) with torch.save: load them weights-only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _first_cause(error: BaseException) -> BaseException:
    """DCP wraps each rank's failure in a CheckpointException; the first one is what the user needs."""
    if isinstance(error, CheckpointException):
        causes = [exc for exc, _ in error.failures.values()]
        return next((c for c in causes if isinstance(c, CheckpointError)), causes[0] if causes else error)
    return error


SAVE_HINT = "free space or fix the permissions and limits of checkpoint.dir, then resume from the last checkpoint"


@contextmanager
def dcp_errors(path: Path, action: str = "load", hint: Callable[[], str] = lambda: SAVE_HINT) -> Iterator[None]:
    """Turns the DCP failures a user can fix into a CheckpointError naming `path` (or the file a safe read named):
    the file system's (disk full, read-only, permissions, a file-size limit) and an unreadable file's; a failed
    save's line ends with `hint()` (what is kept, what to do: asked only then). Anything else is a bug in nanotron
    or torch: it stays a traceback (with the rank), so it gets reported, not worked around."""
    try:
        with warnings.catch_warnings():  # single-process use is intended, not a mistake to warn about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:
        cause = _first_cause(error)
        if isinstance(cause, CheckpointError):
            raise cause from None
        if action == "save" and _serializer_write_failed(cause):
            cause = _hidden_os_error(Path(path)) or cause  # torch's C++ writer hides the OS error: find it
        if not isinstance(cause, USER_FIXABLE):
            raise
        if action == "save" and isinstance(cause, OSError):
            file = cause.filename or _file_being_written(path)
            raise CheckpointError(
                f"cannot save checkpoint '{path}': writing '{file}' failed ({os_reason(cause)}); {hint()}"
            ) from None
        raise CheckpointError(f"cannot {action} checkpoint '{path}': {short(cause)}") from None


def _serializer_write_failed(error: BaseException) -> bool:
    """torch.save's C++ stream writer failing mid-file (a full disk shows as "[enforce fail at
    inline_container.cc] unexpected pos", or "PytorchStreamWriter failed writing file"), with no OS error."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text)


def _hidden_os_error(folder: Path) -> OSError | None:
    """What the OS refused to the save into `folder`: the file being written stopped at the file-size limit
    (EFBIG, which a fresh probe file would not meet), or what a probe write gets now (a full disk: ENOSPC)."""
    file, limit = _file_being_written(folder), file_size_limit()
    if limit is not None and isinstance(file, Path) and file.is_file() and file.stat().st_size >= limit:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(file))
    return _probe_write(folder)


def _probe_write(folder: Path) -> OSError | None:
    """The OS error a 64 KiB write into `folder` gets now (e.g. No space left on device), or None if it works."""
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(65536))
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        error.filename = None  # the probe is ours: name the checkpoint's file instead
        return error
    finally:
        with suppress(OSError):
            probe.unlink(missing_ok=True)
    return None


def _file_being_written(folder: Path) -> Path | str:
    """This rank's newest file in a checkpoint being saved: the one a failed write without a file name hit."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    files = sorted(folder.glob(f"__{rank}_*"), key=lambda f: f.stat().st_mtime_ns)
    return files[-1] if files else folder


def load_dcp(path: Path, state: dict[str, Any], metadata: Metadata | None = None) -> None:
    """dcp.load into `state` (in place) through the safe reader and planner; works with or without a group."""
    metadata = metadata or read_metadata(path)
    with dcp_errors(path):
        dcp.load(
            state,
            storage_reader=_SafeReader(path, metadata),
            planner=_SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )


def verified_checkpoint(path: Path, allow_unverified: bool = False) -> Path:
    """The step dir `path` names (see `find_checkpoint`), after checking every file against its checksum in this
    process: what a single-process reader (export, generate) calls before reading anything from it. Without
    checksums.json it is refused unless `allow_unverified` (their `--allow_unverified` flag)."""
    step_dir = find_checkpoint(path)
    integrity.check(step_dir, allow_unverified, "--allow_unverified", alone=True)
    return step_dir


def read_model_weights(path: Path, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The model tensors `expected` names (name -> shape, from the model config), full, read in this one process.

    The index is untrusted: its shapes are checked against `expected` before anything is allocated (a claimed
    2^20 x 2^20 tensor is a config mismatch, not an allocation). Check the files with `verified_checkpoint` first.
    """
    metadata = read_metadata(path)
    found = {
        key.removeprefix("model."): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not found:
        raise CheckpointError(f"'{path}' holds no model weights")
    for name, shape in expected.items():
        problem = "is missing" if name not in found else None
        if problem is None and list(found[name].size) != list(shape):
            problem = f"has shape {list(found[name].size)}, but its config.toml says {list(shape)}"
        if problem:
            raise CheckpointError(f"checkpoint '{path}': {name} {problem}; the checkpoint and its config disagree")
    state = {name: torch.empty(found[name].size, dtype=found[name].properties.dtype) for name in expected}
    wrapped = {"model": state}
    load_dcp(path, wrapped, metadata)
    return wrapped["model"]
