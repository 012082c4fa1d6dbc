"""Checkpoints: torch DCP directories committed atomically, auto-resume, resharding to any layout.

On disk (checkpoint.dir, default <run dir>/checkpoints):
    step-N/            committed checkpoint: DCP shards + .metadata (model, optimizer), rng/rank-R.pt,
                       config.toml (the resolved run config), tokenizer/ (a copy), trainer_state.json
    step-N.tmp/        a save in progress (or killed mid-way): never loaded, removed at the next start
    step-N.deleting/   an old checkpoint being removed (keep_last, or replaced): never loaded
    latest             text file naming the newest committed step dir, replaced atomically
Every rank writes its shards into step-N.tmp; only after all ranks finished does rank 0 add
trainer_state.json (the commit marker) and rename the dir, so a visible step-N is always complete and a
process killed at any moment leaves either the previous checkpoint or the new one for "auto" to pick.

Files are untrusted input: DCP's pickled .metadata is read with an allow-list unpickler, every other
non-tensor value and the RNG files with `torch.load(weights_only=True)`, the rest is JSON/TOML. A missing,
truncated or corrupt file is a `CheckpointError` naming it.

Preemption (SIGUSR1/SIGTERM) is handled by the trainer: every rank stops at the same step boundary, a
checkpoint is saved and the process exits 0 (see README, "Checkpoints").
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.futures import Future

from nanotron.config import Config, ModelConfig, to_toml
from nanotron.errors import CheckpointError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    from nanotron.distributed import ParallelContext
    from nanotron.train import Trainer

STEP_DIR = re.compile(r"^step-(\d+)$")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
COMMIT_FILE = "trainer_state.json"
TOKENIZER_FILES = "tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json chat_template.jinja"

# ---- untrusted files --------------------------------------------------------------------------------

_DCP_INDEX_CLASSES = "Metadata MetadataIndex StorageMeta TensorProperties TensorStorageMetadata ChunkStorageMetadata"
_ALLOWED_GLOBALS = {f"torch.distributed.checkpoint.metadata.{name}" for name in _DCP_INDEX_CLASSES.split()} | {
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout",
    "torch.Size",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "collections.OrderedDict",
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata but refuses any class a checkpoint index never contains (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
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
        raise CheckpointError(f"'{file}' is corrupt or not a DCP index ({_short(error)})") from None
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
                raise CheckpointError(f"'{self.folder / name}' is corrupt ({_short(error)})") from None
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


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1][:300]}" if text else type(error).__name__


def _first_cause(error: BaseException) -> BaseException:
    """DCP wraps each rank's failure in a CheckpointException; the first one is what the user needs."""
    if isinstance(error, CheckpointException):
        causes = [exc for exc, _ in error.failures.values()]
        return next((c for c in causes if isinstance(c, CheckpointError)), causes[0] if causes else error)
    return error


@contextmanager
def _dcp_errors(path: Path, action: str = "load") -> Iterator[None]:
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
        raise CheckpointError(f"cannot {action} checkpoint '{path}': {_short(cause)}") from None


def load_dcp(path: Path, state: dict[str, Any], metadata: Metadata | None = None) -> None:
    """dcp.load into `state` (in place) through the safe reader and planner; works with or without a group."""
    metadata = metadata or read_metadata(path)
    with _dcp_errors(path):
        dcp.load(
            state,
            storage_reader=_SafeReader(path, metadata),
            planner=_SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )


# ---- checkpoint folders -----------------------------------------------------------------------------


def preflight(cfg: Config) -> None:
    """Fails before any process group exists if the run or checkpoint dir can't be written."""
    for key, folder in (("job.out_dir", cfg.run_dir), ("checkpoint.dir", cfg.checkpoint_dir)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
        except OSError as error:
            raise CheckpointError(
                f"{key}: cannot write to '{folder}' ({error.strerror}); choose a writable folder"
            ) from None


def _step(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def is_committed(path: Path) -> bool:
    return bool(STEP_DIR.match(path.name)) and (path / COMMIT_FILE).is_file()


def committed_steps(folder: Path) -> list[Path]:
    """Committed step dirs, oldest first (a dir counts once its trainer_state.json exists)."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if is_committed(p)), key=_step)


def latest_checkpoint(folder: Path) -> Path | None:
    """The `latest` pointer if it names a committed dir, else the newest committed dir."""
    pointer = folder / "latest"
    if pointer.is_file():
        target = folder / pointer.read_text().strip()
        if is_committed(target):
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


def read_model_config(path: Path) -> ModelConfig:
    """The [model] section saved with a checkpoint (every committed step dir and every from-hf import has one)."""
    file = path / "config.toml"
    if not file.is_file():
        raise CheckpointError(f"'{file}' is missing: cannot tell the model shape of '{path}'")
    try:
        table = tomllib.loads(file.read_text())["model"]
        names = {f.name for f in fields(ModelConfig)}
        unknown = sorted(set(table) - names)
        if unknown:
            raise KeyError(f"unknown model keys {unknown}")
        model = ModelConfig(**table)
        missing = [f.name for f in fields(ModelConfig) if getattr(model, f.name) is None]
        if missing:
            raise KeyError(f"model keys {missing} are unset")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"'{file}' has no usable [model] section ({_short(error)})") from None
    return model


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """Full model tensors (HF/nanotron names) of a checkpoint, read in this one process."""
    metadata = read_metadata(path)
    state = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"'{path}' holds no model weights")
    wrapped = {"model": state}
    load_dcp(path, wrapped, metadata)
    return wrapped["model"]


def copy_tokenizer(source: Path, dest: Path) -> bool:
    """Copies a tokenizer (a tokenizer.json file, or the HF tokenizer files of a dir) into `dest`."""
    folder = source if source.is_dir() else source.parent
    files = [folder / name for name in TOKENIZER_FILES.split() if (folder / name).is_file()]
    if source.is_file() and source.name != "tokenizer.json":
        files = [f for f in files if f.name != "tokenizer.json"]
    if not files and not source.is_file():
        return False
    dest.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copyfile(file, dest / file.name)
    if source.is_file():
        shutil.copyfile(source, dest / "tokenizer.json")
    return True


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Renames first, then deletes: a removal killed half-way leaves a `.deleting` dir nothing will load."""
    doomed = path.with_name(path.name + ".deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- the trainer's checkpointer ---------------------------------------------------------------------


class Checkpointer:
    """Saves and restores everything a run needs to continue: model, optimizer, schedule, progress, RNG."""

    def __init__(self, cfg: Config, ctx: ParallelContext, trainer: Trainer):
        self.cfg, self.ctx, self.trainer = cfg, ctx, trainer
        self.folder = cfg.checkpoint_dir
        self.pending: tuple[Future, Path, Path, dict] | None = None
        self.last_saved_step = -1
        # Async saves run collectives from a background thread: give them their own process group.
        self.async_group = (
            dist.new_group(backend="gloo") if cfg.checkpoint.async_save and dist.is_initialized() else None
        )

    # ---- state dicts ------------------------------------------------------------------------------

    def model_state(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for module in self.trainer.modules:
            state.update(get_model_state_dict(module))
        return state

    def optimizer_state(self) -> dict[str, object]:
        state: dict[str, object] = {}
        for module, optimizer in zip(self.trainer.modules, self.trainer.optimizers):
            state.update(get_optimizer_state_dict(module, optimizer, options=OPTIONS))
        return state

    # ---- save ---------------------------------------------------------------------------------------

    def save(self, final: bool = False) -> None:
        """Writes step-N.tmp on every rank; the commit (rename) follows at once, or when an async save ends."""
        self.wait()
        step = self.trainer.state.step
        if step == self.last_saved_step:  # e.g. the final save right after an interval save of the same step
            return
        self.last_saved_step = step
        target, tmp = self.folder / f"step-{step}", self.folder / f"step-{step}.tmp"
        if self.ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        rng = {"cpu": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        torch.save(rng, tmp / "rng" / f"rank-{self.ctx.rank}.pt")
        state = {"model": self.model_state()}
        if step > 0:  # before the first step there is no optimizer state (and asking for it would fake a step)
            state["optimizer"] = self.optimizer_state()
        progress = self.progress()
        with _dcp_errors(tmp, "save"):
            if self.cfg.checkpoint.async_save and not final:
                future = dcp.async_save(
                    state, checkpoint_id=str(tmp), process_group=self.async_group, no_dist=not dist.is_initialized()
                )
                self.pending = (future, tmp, target, progress)
                return
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        self.commit(tmp, target, progress)

    def progress(self) -> dict:
        """What trainer_state.json records: taken when the save starts, not when an async save commits."""
        p = self.cfg.parallelism
        return {
            **vars(self.trainer.state),
            "global_batch_size": self.cfg.training.global_batch_size,
            "scheduler": self.trainer.schedulers[0].state_dict(),
            "world_size": self.ctx.world_size,
            "layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage},
        }

    def wait(self) -> None:
        """Finishes and commits an async save still in flight."""
        if self.pending is not None:
            future, tmp, target, progress = self.pending
            self.pending = None
            with _dcp_errors(tmp, "save"):
                future.result()
            self.commit(tmp, target, progress)

    def commit(self, tmp: Path, target: Path, progress: dict) -> None:
        """After every rank's shards are written: config, tokenizer, then the commit marker and the rename."""
        _barrier()
        if self.ctx.rank == 0:
            self.check_complete(tmp)
            (tmp / "config.toml").write_text(to_toml(self.cfg))
            copy_tokenizer(Path(self.cfg.data.tokenizer), tmp / "tokenizer")
            _write_atomic(tmp / COMMIT_FILE, json.dumps(progress, indent=1))
            if target.exists():  # left by an earlier run that went further, then resumed from before it
                _remove(target)
            os.rename(tmp, target)
            _fsync_dir(self.folder)
            _write_atomic(self.folder / "latest", target.name + "\n")
            self.prune(_step(target))
            self.trainer.metrics.info(f"checkpoint: saved {target}")
        _barrier()

    def check_complete(self, tmp: Path) -> None:
        """Every rank's files must be visible where rank 0 commits: catches a checkpoint.dir that isn't shared."""
        try:
            read_metadata(tmp)
            missing = [r for r in range(self.ctx.world_size) if not (tmp / "rng" / f"rank-{r}.pt").is_file()]
            if missing:
                raise CheckpointError(f"'{tmp / 'rng'}' lacks the files of ranks {missing}")
        except CheckpointError as error:
            raise CheckpointError(
                f"not committing {tmp}: {error}; is checkpoint.dir on a filesystem that every node shares?"
            ) from None

    def prune(self, newest: int) -> None:
        """Keeps the newest keep_last checkpoints up to `newest`; later ones (of an abandoned branch) stay."""
        keep = self.cfg.checkpoint.keep_last
        if keep:
            older = [p for p in committed_steps(self.folder) if _step(p) <= newest]
            for old in older[:-keep]:
                _remove(old)

    # ---- load ---------------------------------------------------------------------------------------

    def resolve_resume(self) -> Path | None:
        wanted = self.cfg.checkpoint.resume_from
        if wanted in ("none", ""):
            return None
        if wanted in ("auto", "latest"):
            found = latest_checkpoint(self.folder)
            if found is None and wanted == "latest":
                raise CheckpointError(
                    f"checkpoint.resume_from='latest' but '{self.folder}' holds no committed "
                    "checkpoint; use 'auto' to start fresh when there is none"
                )
            return found
        path = Path(wanted)
        if not is_committed(path):
            raise CheckpointError(
                f"checkpoint.resume_from: '{wanted}' is not a committed checkpoint dir "
                f"(expected a step-N folder with {COMMIT_FILE}); use 'auto', 'latest' or 'none'"
            )
        return path

    def resume(self) -> None:
        """Loads the checkpoint named by checkpoint.resume_from, or model weights from init_from, or nothing."""
        if self.ctx.rank == 0 and self.folder.is_dir():
            for stale in [*self.folder.glob("step-*.tmp"), *self.folder.glob("step-*.deleting")]:
                shutil.rmtree(stale, ignore_errors=True)
        path = self.resolve_resume()
        if path is None:
            if self.cfg.checkpoint.init_from:
                init = Path(self.cfg.checkpoint.init_from)
                if not init.is_dir():
                    raise CheckpointError(f"checkpoint.init_from: '{init}' does not exist")
                self.load(init, weights_only=True)
                self.trainer.metrics.info(f"checkpoint: model weights initialised from {init}")
            return
        self.load(path, weights_only=False)
        self.last_saved_step = self.trainer.state.step
        self.trainer.metrics.info(f"checkpoint: resumed from {path} at step {self.trainer.state.step}")

    def load(self, path: Path, weights_only: bool) -> None:
        """Loads into this rank's shards whatever the layout of the save (DCP reshards)."""
        metadata = read_metadata(path)
        state: dict[str, object] = {"model": self.model_state()}
        self.check_model_shapes(path, metadata, state["model"])
        with_optimizer = not weights_only and any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)
        if with_optimizer:
            state["optimizer"] = self.optimizer_state()
        load_dcp(path, state, metadata)
        for module in self.trainer.modules:
            set_model_state_dict(module, state["model"], options=StateDictOptions(strict=False))
        if with_optimizer:
            for module, optimizer in zip(self.trainer.modules, self.trainer.optimizers):
                set_optimizer_state_dict(module, optimizer, state["optimizer"], options=OPTIONS)
        if not weights_only:
            self.load_trainer_state(path)

    @staticmethod
    def check_model_shapes(path: Path, metadata: Metadata, model_state: dict[str, torch.Tensor]) -> None:
        """A checkpoint of another model shape is a config mistake: say so instead of a DCP size error."""
        saved = metadata.state_dict_metadata
        for name, tensor in model_state.items():
            meta = saved.get(f"model.{name}")
            problem = None
            if meta is None:
                problem = "is missing there"
            elif isinstance(meta, TensorStorageMetadata) and meta.size != tensor.shape:
                problem = f"has shape {list(meta.size)} there but {list(tensor.shape)} here"
            if problem:
                raise CheckpointError(
                    f"checkpoint '{path}' does not match the configured model: {name} {problem}; "
                    f"use the [model] settings the checkpoint was made with ({path / 'config.toml'})"
                )

    def load_trainer_state(self, path: Path) -> None:
        file = path / COMMIT_FILE
        try:
            saved = json.loads(file.read_text())
            scheduler = saved["scheduler"]
            for key in ("step", "consumed_samples", "consumed_tokens"):
                setattr(self.trainer.state, key, int(saved[key]))
            for sched in self.trainer.schedulers:
                sched.load_state_dict(scheduler)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"'{file}' is unreadable or incomplete ({_short(error)})") from None
        gbs = self.cfg.training.global_batch_size
        if saved.get("global_batch_size", gbs) != gbs and self.ctx.rank == 0:
            print(
                f"warning: training.global_batch_size is {gbs} but was {saved['global_batch_size']} in {path}; "
                f"data resumes at global sample {self.trainer.state.step * gbs}, not at consumed_samples "
                f"{self.trainer.state.consumed_samples}",
                flush=True,
            )
        self.restore_rng(path, saved)

    def restore_rng(self, path: Path, saved: dict) -> None:
        """RNG streams are per rank: restored only when the layout is the same as at the save."""
        p = self.cfg.parallelism
        same_layout = saved.get("world_size") == self.ctx.world_size and all(
            saved.get("layout", {}).get(key) == getattr(p, key) for key in ("dp", "tp", "pp")
        )
        rng_file = path / "rng" / f"rank-{self.ctx.rank}.pt"
        if not same_layout or not rng_file.is_file():
            return
        try:
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.ctx.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.ctx.device)
        except Exception as error:
            raise CheckpointError(f"'{rng_file}' is corrupt ({_short(error)})") from None
