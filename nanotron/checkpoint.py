"""Checkpoints: torch DCP directories committed atomically, auto-resume, resharding to any layout.

On disk (checkpoint.dir, default <run dir>/checkpoints):
    step-N/            committed checkpoint: DCP shards + .metadata, trainer_state.json, rng/rank-R.pt
    step-N.tmp/        a save in progress (or killed mid-way): never loaded, removed at the next start
    latest             text file naming the newest committed step dir, replaced atomically
Every rank writes its shards into step-N.tmp; only after all ranks finished does rank 0 add
trainer_state.json and rename the dir, so a visible step-N is always complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nanotron.config import Config
from nanotron.errors import CheckpointError

if TYPE_CHECKING:
    from nanotron.distributed import ParallelContext
    from nanotron.train import Trainer

STEP_DIR = re.compile(r"^step-(\d+)$")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def preflight(cfg: Config) -> None:
    """Fails before any process group exists if the run or checkpoint dir can't be written."""
    for key, folder in (("job.out_dir", cfg.run_dir), ("checkpoint.dir", cfg.checkpoint_dir)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
        except OSError as error:
            raise CheckpointError(f"{key}: cannot write to '{folder}' ({error.strerror}); "
                                  "choose a writable folder") from None


def committed_steps(folder: Path) -> list[Path]:
    """Committed step dirs, oldest first (a dir counts once its trainer_state.json exists)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / "trainer_state.json").is_file()]


def latest_checkpoint(folder: Path) -> Path | None:
    """The `latest` pointer if it names a committed dir, else the newest committed dir."""
    pointer = folder / "latest"
    if pointer.is_file():
        target = folder / pointer.read_text().strip()
        if STEP_DIR.match(target.name) and (target / "trainer_state.json").is_file():
            return target
    steps = committed_steps(folder)
    return steps[-1] if steps else None


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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves and restores everything a run needs to continue: model, optimizer, schedule, progress, RNG."""

    def __init__(self, cfg: Config, ctx: ParallelContext, trainer: Trainer):
        self.cfg, self.ctx, self.trainer = cfg, ctx, trainer
        self.folder = cfg.checkpoint_dir
        self.pending: tuple[object, Path, Path, dict] | None = None
        # Async saves run collectives from a background thread: give them their own process group.
        self.async_group = (dist.new_group(backend="gloo")
                            if cfg.checkpoint.async_save and dist.is_initialized() else None)

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
        self.wait()
        step = self.trainer.state.step
        target = self.folder / f"step-{step}"
        if target.exists():  # e.g. the final save right after an interval save of the same step
            return
        tmp = self.folder / f"step-{step}.tmp"
        if self.ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        torch.save({"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()}
                                                     if self.ctx.device.type == "cuda" else {})},
                   tmp / "rng" / f"rank-{self.ctx.rank}.pt")
        state = {"model": self.model_state(), "optimizer": self.optimizer_state()}
        progress = self.progress()
        if self.cfg.checkpoint.async_save and not final:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.async_group)
            self.pending = (future, tmp, target, progress)
            return
        dcp.save(state, checkpoint_id=str(tmp))
        self.commit(tmp, target, progress)

    def progress(self) -> dict:
        """What trainer_state.json records: taken when the save starts, not when an async save commits."""
        return {**vars(self.trainer.state), "scheduler": self.trainer.schedulers[0].state_dict(),
                "world_size": self.ctx.world_size, "parallelism": dict(vars(self.cfg.parallelism))}

    def wait(self) -> None:
        """Finishes and commits an async save still in flight."""
        if self.pending is not None:
            future, tmp, target, progress = self.pending
            self.pending = None
            future.result()
            self.commit(tmp, target, progress)

    def commit(self, tmp: Path, target: Path, progress: dict) -> None:
        _barrier()
        if self.ctx.rank == 0:
            _write_atomic(tmp / "trainer_state.json", json.dumps(progress, indent=1))
            os.rename(tmp, target)
            _fsync_dir(self.folder)
            _write_atomic(self.folder / "latest", target.name + "\n")
            self.prune()
            self.trainer.metrics.info(f"checkpoint: saved {target}")
        _barrier()

    def prune(self) -> None:
        keep = self.cfg.checkpoint.keep_last
        if keep:
            for old in committed_steps(self.folder)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    # ---- load ---------------------------------------------------------------------------------------

    def resolve_resume(self) -> Path | None:
        wanted = self.cfg.checkpoint.resume_from
        if wanted in ("none", ""):
            return None
        if wanted in ("auto", "latest"):
            found = latest_checkpoint(self.folder)
            if found is None and wanted == "latest":
                raise CheckpointError(f"checkpoint.resume_from='latest' but '{self.folder}' holds no committed "
                                      "checkpoint; use 'auto' to start fresh when there is none")
            return found
        path = Path(wanted)
        if path.name.endswith(".tmp") or not (path / "trainer_state.json").is_file():
            raise CheckpointError(f"checkpoint.resume_from: '{wanted}' is not a committed checkpoint dir "
                                  "(expected a step-N folder with trainer_state.json)")
        return path

    def resume(self) -> None:
        """Loads the checkpoint named by checkpoint.resume_from, or model weights from init_from, or nothing."""
        if self.ctx.rank == 0:
            for stale in self.folder.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        path = self.resolve_resume()
        if path is None:
            if self.cfg.checkpoint.init_from:
                self.load(Path(self.cfg.checkpoint.init_from), weights_only=True)
            return
        self.load(path, weights_only=False)
        self.trainer.metrics.info(f"checkpoint: resumed from {path} at step {self.trainer.state.step}")

    def load(self, path: Path, weights_only: bool) -> None:
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"'{path / '.metadata'}' is missing: '{path}' is not a complete DCP checkpoint")
        state: dict[str, object] = {"model": self.model_state()}
        if not weights_only:
            state["optimizer"] = self.optimizer_state()
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as error:  # DCP wraps per-rank failures; name the folder, keep the cause short
            cause = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"cannot load checkpoint '{path}': {cause}") from None
        for module in self.trainer.modules:
            set_model_state_dict(module, state["model"], options=StateDictOptions(strict=False))
        if weights_only:
            return
        for module, optimizer in zip(self.trainer.modules, self.trainer.optimizers):
            set_optimizer_state_dict(module, optimizer, state["optimizer"], options=OPTIONS)
        self.load_trainer_state(path)

    def load_trainer_state(self, path: Path) -> None:
        try:
            saved = json.loads((path / "trainer_state.json").read_text())
            scheduler = saved.pop("scheduler")
            for key in ("step", "consumed_samples", "consumed_tokens"):
                setattr(self.trainer.state, key, int(saved[key]))
        except (OSError, ValueError, KeyError) as error:
            raise CheckpointError(f"'{path / 'trainer_state.json'}' is unreadable or incomplete ({error})") from None
        for sched in self.trainer.schedulers:
            sched.load_state_dict(scheduler)
        rng_file = path / "rng" / f"rank-{self.ctx.rank}.pt"
        if saved.get("world_size") == self.ctx.world_size and rng_file.is_file():
            try:
                rng = torch.load(rng_file, weights_only=True)
            except Exception as error:
                raise CheckpointError(f"'{rng_file}' is corrupt ({type(error).__name__})") from None
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.ctx.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"])
