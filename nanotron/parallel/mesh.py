"""Process group and the DeviceMesh, ("pp", "dp", "tp") or with HSDP ("pp", "dp_replicate", "dp_shard", "tp"),
and "cp" before "tp" when context parallelism is on; nccl on CUDA, gloo on CPU.

A process group exists even for one plain process (`python -m nanotron.train`, no launcher): a world of
one over an in-memory store, so every layout, dp=1 included, runs the same parallel code.

Collective timeouts come from `[distributed]`: every group (the world's, each mesh dimension's and each flattened
one's, which torch would otherwise create with its own default, 10 min on NCCL) waits up to
`startup_timeout_minutes` until the first step is done (rank 0 tokenizing a small corpus, checkpoint loading,
compilation), then `timeout_minutes`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nanotron.config import Config
from nanotron.errors import ConfigError
from nanotron.parallel.torch_private import (
    concatenate_meshes,
    flatten_mesh,
    flattened_meshes,
    set_group_timeout,
    submesh,
    unflatten_mesh,
)


def pick_device(cfg: Config) -> torch.device:
    wanted = cfg.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device='cuda' but no CUDA device is visible; use training.device='cpu' or 'auto'")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


@dataclass
class ParallelContext:
    """Where this rank sits: its device, mesh and coordinates on each mesh dimension."""

    mesh: DeviceMesh
    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int = 0
    dp: int = 1  # data-parallel ranks: each reads its own samples
    # ("edp", "ep"): dp x cp split for expert parallelism (ep innermost); None when ep = 1
    expert_mesh: DeviceMesh | None = None
    timeout: timedelta = timedelta(minutes=30)  # distributed.timeout_minutes, applied by end_startup()
    in_startup: bool = True

    def groups(self) -> list[dist.ProcessGroup]:
        """The world, every mesh dimension's group and every flattened one's (HSDP's dp, dp x cp, FSDP's dp_shard x
        cp, Muon's stage), and the expert mesh's."""
        groups = [
            dist.group.WORLD,
            *(self.mesh.get_group(n) for n in self.mesh.mesh_dim_names),
            *(flat.get_group() for flat in flattened_meshes(self.mesh)),
            *([self.expert_mesh.get_group(n) for n in ("edp", "ep")] if self.expert_mesh is not None else []),
        ]
        return list({id(group): group for group in groups}.values())

    def loss_group(self) -> dist.ProcessGroup | None:
        """The ranks whose losses together cover the global batch (dp x cp: `loss_mesh`); None when it is one."""
        mesh = loss_mesh(self.mesh)
        return mesh.get_group() if mesh.size() > 1 else None

    def end_startup(self) -> None:
        """From now on collectives fail after distributed.timeout_minutes (called after each step; once it acts)."""
        if self.in_startup:
            set_timeout(self.groups(), self.timeout)
            self.in_startup = False

    def agree(
        self, flags: list[torch.Tensor | bool], values: list[torch.Tensor | float] = ()
    ) -> tuple[list[bool], list[float]]:
        """For each flag, whether it is true on any rank, and each value summed over the ranks: one tiny all-reduce
        and one host sync for all. Every rank receives the same sums, so decisions taken from them agree."""
        parts = [self._scalar(f) != 0 for f in flags]
        parts += [self._scalar(v) for v in values]
        out = torch.stack([p.double() for p in parts]) if parts else torch.zeros(0, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(out)
        host = out.tolist()
        return [v > 0 for v in host[: len(flags)]], host[len(flags) :]

    def _scalar(self, value: torch.Tensor | bool | float) -> torch.Tensor:
        """A host number filled in on the device (a copy from the host would make a GPU's host wait for it)."""
        if isinstance(value, torch.Tensor):
            return value.reshape(())
        return torch.full((), float(value), dtype=torch.float64, device=self.device)

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (float64), in rank order: one all-gather, for rare steps (a stability replay)."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        every = [mine]
        if self.world_size > 1:
            every = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(every, mine)
        return [row.tolist() for row in every]


def init_distributed(cfg: Config) -> ParallelContext:
    """Joins (or, for one plain process, creates) the process group and builds the mesh."""
    device = pick_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    startup = timedelta(minutes=cfg.distributed.startup_timeout_minutes)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        options = {"timeout": startup, "device_id": device if backend == "nccl" else None}
        if "RANK" in os.environ:
            dist.init_process_group(backend, **options)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    mesh = build_mesh(cfg, device.type)
    context = ParallelContext(
        mesh,
        device,
        dist.get_rank(),
        dist.get_world_size(),
        submesh(mesh, "dp").get_local_rank(),
        mesh["tp"].get_local_rank(),
        mesh["pp"].get_local_rank(),
        mesh["cp"].get_local_rank() if cfg.parallelism.cp > 1 else 0,
        dp=cfg.parallelism.dp,
        expert_mesh=expert_mesh(mesh, cfg.parallelism.ep),
        timeout=timedelta(minutes=cfg.distributed.timeout_minutes),
    )
    set_timeout(context.groups(), startup)
    if context.world_size > 1:
        # No rank's own code runs (and may fail) before every peer has connected to every group: a gloo peer
        # still connecting when a rank leaves prints a C++ error line beside that rank's one-line error.
        dist.barrier()
    return context


def set_timeout(groups: list[dist.ProcessGroup], timeout: timedelta) -> None:
    """The collective timeout of existing groups (NCCL and gloo backends)."""
    for group in groups:
        set_group_timeout(group, timeout)


def build_mesh(cfg: Config, device_type: str) -> DeviceMesh:
    """tp innermost (fastest links), then cp, then the FSDP group, so they stay inside a node when they fit.

    With HSDP (dp_shard < dp, zero_stage >= 1) dp splits into ("dp_replicate", "dp_shard"), and "dp" is
    their flattening: `mesh["dp"]` always spans every data-parallel rank (data loading). With cp > 1,
    "dp_cp" spans dp x cp: the ranks whose losses make the global batch's mean and that share gradients
    (FSDP shards over "dp_shard_cp" under HSDP). "stage" (Muon only) spans all dims but pp.
    """
    p, shard = cfg.parallelism, cfg.dp_shard_size
    cp_dim = {"cp": p.cp} if p.cp > 1 else {}
    if p.zero_stage == 0 or shard == p.dp:
        dims = {"pp": p.pp, "dp": p.dp, **cp_dim, "tp": p.tp}
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        if cp_dim:
            flatten_mesh(mesh, ("dp", "cp"), "dp_cp")
        return _with_stage(mesh, cfg)
    dims = {"pp": p.pp, "dp_replicate": p.dp // shard, "dp_shard": shard, **cp_dim, "tp": p.tp}
    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp")
    if cp_dim:
        flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        flatten_mesh(mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")
    return _with_stage(mesh, cfg)


def _with_stage(mesh: DeviceMesh, cfg: Config) -> DeviceMesh:
    """Muon's "stage": every rank of one pipeline stage (all dims but pp), which hold the same parameters'
    shards and exchange them once per step. Made only for Muon (one more communicator per stage)."""
    if cfg.optimizer.name == "muon":
        flatten_mesh(mesh, tuple(name for name in mesh.mesh_dim_names if name != "pp"), "stage")
    return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP/replicate works on: 2-D (replicate, shard) for HSDP, else 1-D; cp ranks hold the same
    parameters, so they shard (or replicate) them together with dp."""
    names = mesh.mesh_dim_names or ()
    cp = "cp" in names
    if "dp_shard" in names:
        return submesh(mesh, "dp_replicate", "dp_shard_cp" if cp else "dp_shard")
    return submesh(mesh, "dp_cp" if cp else "dp")


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh | None:
    """The FSDP group (dp x cp; dp_shard x cp under HSDP) as ("edp", "ep"), ep innermost: experts are split over
    "ep" and FSDP-sharded over "edp" (and replicated over "dp_replicate" under HSDP)."""
    if ep == 1:
        return None
    names = mesh.mesh_dim_names or ()
    if "dp_shard" in names:
        group = submesh(mesh, "dp_shard_cp" if "cp" in names else "dp_shard")
    else:
        group = loss_mesh(mesh)
    return unflatten_mesh(group, (group.size() // ep, ep), ("edp", "ep"))


def expert_data_mesh(mesh: DeviceMesh, experts: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP works on for expert weights: "edp", or ("dp_replicate", "edp") under HSDP."""
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        return concatenate_meshes([mesh["dp_replicate"], experts["edp"]])
    return experts["edp"]


def loss_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks (of one pp stage and tp rank) whose losses together cover the global batch: dp x cp."""
    return submesh(mesh, "dp_cp" if "cp" in (mesh.mesh_dim_names or ()) else "dp")


def destroy_distributed() -> None:
    """Tears the process group down; only on success (after an error a peer may never join the teardown)."""
    if dist.is_initialized():
        dist.destroy_process_group()
