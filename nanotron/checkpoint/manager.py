"""Checkpoint manager: saves and restores a dict of stateful components, knowing nothing of the trainer.

Components with tensors (model, optimizer: anything with `state_dict()`/`load_state_dict()`) go to a torch
DCP directory, which reshards on load to any dp/tp/pp layout; `progress` (step, consumed samples; a small
JSON-able state) becomes trainer_state.json, the commit marker. Every rank writes its shards into
step-N.tmp; after a barrier rank 0 checks that every rank's files are visible, adds the extras (config,
tokenizer) and commits (see `layout`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.futures import Future

import nanotron.checkpoint.integrity as integrity
import nanotron.checkpoint.layout as layout
from nanotron import records
from nanotron.checkpoint.safe_io import dcp_errors, load_dcp, read_metadata
from nanotron.checkpoint.torch_private import stager_keeps_its_buffers
from nanotron.config import CheckpointConfig
from nanotron.config.validate import check_async_mode
from nanotron.errors import CheckpointError, short, storage_errors
from nanotron.step_end import StepInfo

UNVERIFIED_OPTION = "checkpoint.allow_unverified=true"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def resolve_source(folder: Path, options: CheckpointConfig) -> tuple[Path, bool] | None:
    """What a start loads, as (path, model_only): checkpoint.resume_from's checkpoint, else the model weights
    of checkpoint.init_from, else nothing (a fresh start)."""
    wanted = options.resume_from
    if wanted == "":  # an unset shell variable: --checkpoint.resume_from=$RESUME
        raise CheckpointError(
            "checkpoint.resume_from: expected 'auto', 'latest', 'none' or a step-N checkpoint folder, "
            "got an empty value"
        )
    if wanted == "none" and (earlier := layout.latest_checkpoint(folder)) is not None:
        raise CheckpointError(
            f"checkpoint.resume_from='none' but '{folder}' holds checkpoints of an earlier run (up to {earlier.name}): "
            "a fresh start would overwrite them; resume it (checkpoint.resume_from=auto), or give this run another "
            "job.name or checkpoint.dir"
        )
    if wanted in ("auto", "latest"):
        found = layout.latest_checkpoint(folder)
        if found is None and wanted == "latest":
            raise CheckpointError(
                f"checkpoint.resume_from='latest' but '{folder}' holds no committed "
                "checkpoint; use 'auto' to start fresh when there is none"
            )
        if found is not None:
            return found, False
    elif wanted != "none":
        path = Path(wanted)
        if not layout.is_committed(path):
            problem = f"is not a committed checkpoint dir (expected a step-N folder with {layout.COMMIT_FILE})"
            if not path.exists():
                problem = "does not exist"
            elif latest := layout.latest_checkpoint(path) or layout.latest_checkpoint(path / "checkpoints"):
                problem = f"is a folder of checkpoints: give one, e.g. its latest '{latest}'"
            raise CheckpointError(f"checkpoint.resume_from: '{wanted}' {problem}; or use 'auto', 'latest' or 'none'")
        return path, False
    if options.init_from:
        if not Path(options.init_from).is_dir():
            raise CheckpointError(f"checkpoint.init_from: '{options.init_from}' does not exist")
        return Path(options.init_from), True
    return None


class CheckpointManager:
    """Saves `states` (DCP) and `progress` (JSON) to step dirs of `folder`; loads them back at any layout.

    `write_extras(step_dir)` runs on rank 0 before each commit (e.g. the resolved config and the tokenizer);
    `meta` is recorded in trainer_state.json for people and tools (layout, batch size) and never loaded;
    `progress_schema` checks the whole of trainer_state.json before `progress` gets it.

    Async saves copy the state to host memory in a background thread ("staging") into buffers kept from one
    save to the next (pinned, with non-blocking copies, when `device` is CUDA); the write to disk follows in
    another thread. Whoever changes the state in place (the optimizer step) calls `wait_for_staging()` first.
    """

    def __init__(
        self,
        folder: Path,
        options: CheckpointConfig,
        states: dict[str, Stateful],
        progress: Stateful,
        write_extras: Callable[[Path], None] = lambda step_dir: None,
        meta: dict[str, Any] | None = None,
        log: Callable[[str], None] = print,
        device: torch.device | str = "cpu",
        on_phase: Callable[[str, int], None] = lambda phase, step: None,
        progress_schema: Any = None,
    ):
        self.folder = folder
        self.options = options
        self.states = states
        self.progress = progress
        self.progress_schema = progress_schema or {}  # what trainer_state.json must hold (`nanotron.records`)
        self.write_extras = write_extras
        self.meta = meta or {}
        self.log = log
        self.on_phase = on_phase  # told ("checkpoint", step) as a save starts
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending: tuple[Future, Path, Path, dict] | None = None
        self.staging: Future | None = None
        self.device = torch.device(device)
        self.stager: DefaultStager | None = None
        self.last_saved_step, self.save_started = -1, 0.0
        # Async saves run collectives from a background thread: give them their own process group.
        check_async_mode(options.async_mode, self.device.type)
        background = options.async_mode != "sync"
        self.async_group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None
        if self.rank == 0:
            layout.clean_stale(folder)

    # ---- save ---------------------------------------------------------------------------------------

    def step_end(self, info: StepInfo) -> None:
        """Saves every checkpoint.interval steps, unless the run is stopping (its final save follows)."""
        if not info.stopping and self.options.interval and info.step % self.options.interval == 0:
            self.save(info.step)

    def save(self, step: int, final: bool = False) -> None:
        """Writes step-N.tmp on every rank; the commit follows at once, or when an async save has finished."""
        self.on_phase("checkpoint", step)
        self.wait()
        if step == self.last_saved_step:  # e.g. the final save right after an interval save of the same step
            return
        self.last_saved_step, self.save_started = step, time.perf_counter()
        target, tmp = self.folder / f"step-{step}", self.folder / f"step-{step}.tmp"
        asynchronous = self.options.async_mode != "sync" and not final
        if self.rank == 0:
            self.log(f"checkpoint: saving step {step} to {target}" + (" (async)" if asynchronous else ""))
            with storage_errors("save checkpoint", tmp, self._kept()):
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
        _barrier()
        state = {name: component.state_dict() for name, component in self.states.items()}
        progress = {**self.progress.state_dict(), **self.meta}  # as of now, even if an async save commits later
        with dcp_errors(tmp, "save", self._kept):
            if asynchronous:
                self._async_save(state, tmp, target, progress)
                return
            dcp.save(state, checkpoint_id=str(tmp))
        self._commit(tmp, target, progress)

    def _async_save(self, state: dict, tmp: Path, target: Path, progress: dict) -> None:
        if self.stager is not None and not stager_keeps_its_buffers():  # torch 2.11: one stager per save
            self.stager.close()
            self.stager = None
        if self.stager is None:  # one per run: it keeps its host buffers and refills them at every save
            pinned = self.options.async_mode == "async_pinned"
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=pinned,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=pinned,
                )
            )
        if self.device.type == "cuda":  # the staging stream must not copy before the optimizer step's kernels ran
            torch.cuda.current_stream(self.device).synchronize()
        response = dcp.async_save(
            state, checkpoint_id=str(tmp), process_group=self.async_group, async_stager=self.stager
        )
        self.staging = response.staging_completion
        self.pending = (response.upload_completion, tmp, target, progress)

    def wait_for_staging(self) -> None:
        """Returns once an async save has its copy of the state: the state may then change in place."""
        if self.staging is not None:
            staging, self.staging = self.staging, None
            with dcp_errors(self.pending[1] if self.pending else self.folder, "save", self._kept):
                staging.result()

    def wait(self) -> None:
        """Finishes and commits an async save still in flight."""
        self.wait_for_staging()
        if self.pending is not None:
            future, tmp, target, progress = self.pending
            self.pending = None
            with dcp_errors(tmp, "save", self._kept):
                future.result()
            self._commit(tmp, target, progress)

    def _commit(self, tmp: Path, target: Path, progress: dict) -> None:
        _barrier()
        shard_sums = integrity.shard_checksums(tmp)  # every rank hashes its share of the shards
        if self.rank == 0:
            try:  # every rank's shards must be visible where rank 0 commits
                read_metadata(tmp)
            except CheckpointError as error:
                raise CheckpointError(
                    f"not committing {tmp}: {error}; is checkpoint.dir on a filesystem that every node shares?"
                ) from None
            with storage_errors("commit checkpoint", tmp, self._kept()):
                self.write_extras(tmp)
                layout.commit(tmp, target, progress, partial(integrity.write, shard_sums=shard_sums))
            with storage_errors("prune old checkpoints in", self.folder, f"{target} is saved and latest"):
                layout.prune(self.folder, layout.step_of(target), self.options.keep_last)
            size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) / 2**30
            self.log(f"checkpoint: saved {target} in {time.perf_counter() - self.save_started:.2f}s ({size:.2f} GiB)")
        _barrier()

    def _kept(self) -> str:
        """What a failed save leaves: the last committed checkpoint, still `latest`."""
        last = layout.committed_steps(self.folder)
        kept = f"the last checkpoint, {last[-1]}, stays committed and latest" if last else "no checkpoint was committed"
        return f"{kept}; free space or fix checkpoint.dir, then resume"

    def close(self) -> None:
        """Finishes any save in flight and frees the staging buffers."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    # ---- load ---------------------------------------------------------------------------------------

    def load(self, path: Path, model_only: bool = False, fresh: tuple[str, ...] = ()) -> dict[str, Any] | None:
        """Loads into this rank's shards whatever the layout of the save; returns trainer_state.json's
        content (None with model_only, which loads the model alone, e.g. from an HF import). States named in
        `fresh` keep what they have (checkpoint.reset_optimizer)."""
        metadata = read_metadata(path)
        integrity.check(path, self.options.allow_unverified, UNVERIFIED_OPTION)
        saved = None if model_only else self._read_progress(path)  # a bad one fails before the costly read
        names = ["model"] if model_only else [name for name in self.states if name not in fresh]
        _load_verified(path, {name: self.states[name] for name in names}, metadata)
        if model_only:
            return None
        self.last_saved_step = layout.step_of(path) if layout.STEP_DIR.match(path.name) else -1
        return saved

    def _read_progress(self, path: Path) -> dict[str, Any]:
        """trainer_state.json, checked against `progress_schema`, then loaded into `progress`."""
        file = path / layout.COMMIT_FILE
        saved = records.read(file, self.progress_schema, CheckpointError, "use another checkpoint")
        try:
            self.progress.load_state_dict(saved)
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # a progress without a schema
            raise CheckpointError(f"'{file}' is unreadable or incomplete ({short(error)})") from None
        return saved


def load_states(
    path: Path, states: dict[str, Stateful], allow_unverified: bool = False, metadata: Metadata | None = None
) -> None:
    """Loads `states` (names as saved: "model", "optimizer") from a checkpoint into this rank's shards, at any
    layout, after every rank checked its share of the files' checksums. Also for readers of a saved model
    (`nanotron eval`), which need no manager."""
    metadata = metadata or read_metadata(path)
    integrity.check(path, allow_unverified, UNVERIFIED_OPTION)  # every rank checks its share; all agree
    _load_verified(path, states, metadata)


def _load_verified(path: Path, states: dict[str, Stateful], metadata: Metadata) -> None:
    state = {name: stateful.state_dict() for name, stateful in states.items()}
    check_model_shapes(path, metadata, state["model"])
    for name in states:
        if not any(key.startswith(f"{name}.") for key in metadata.state_dict_metadata):
            raise CheckpointError(f"checkpoint '{path}' holds no {name} state; use it with checkpoint.init_from")
    load_dcp(path, state, metadata)
    for name, stateful in states.items():
        stateful.load_state_dict(state[name])


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


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
