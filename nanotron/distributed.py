"""Process group and the ("pp", "dp", "tp") DeviceMesh; nccl on CUDA, gloo on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nanotron.config import Config, ConfigError


def launched_world_size() -> int:
    """World size from the launcher's environment (torchrun, srun) without touching the network."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(cfg: Config) -> torch.device:
    wanted = cfg.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device='cuda' but no CUDA device is visible; use training.device='cpu' or 'auto'")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


@dataclass
class ParallelContext:
    """Everything the trainer needs to know about where this rank sits."""

    mesh: DeviceMesh | None
    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    tp_rank: int
    pp_rank: int

    @property
    def is_logging_rank(self) -> bool:
        """The first rank of the last pipeline stage: it has the loss (contract 5)."""
        if self.mesh is None:
            return True
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_rank == self.mesh["pp"].size() - 1

    def submesh(self, name: str) -> DeviceMesh | None:
        return None if self.mesh is None else self.mesh[name]


def init_distributed(cfg: Config) -> ParallelContext:
    """Builds the mesh, or nothing when a single process runs without a launcher (plain `python -m`)."""
    device = pick_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ and cfg.world_size == 1:
        return ParallelContext(None, device, 0, 1, 0, 0, 0)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=30), device_id=device if backend == "nccl" else None)
    p = cfg.parallelism
    mesh = init_device_mesh(device.type, (p.pp, p.dp, p.tp), mesh_dim_names=("pp", "dp", "tp"))
    return ParallelContext(
        mesh,
        device,
        dist.get_rank(),
        dist.get_world_size(),
        mesh["dp"].get_local_rank(),
        mesh["tp"].get_local_rank(),
        mesh["pp"].get_local_rank(),
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
