"""`nanotron plan --check`: build ranks of the real world size on torch's fake process group and count bytes.

One process plays rank r of a W-rank world (`init_process_group("fake")`: collectives return at once and
move nothing), builds the mesh and this rank's model exactly as training does (pipeline split, TP plan,
FSDP) on the meta device, and sums the local shards' bytes. No GPU, no memory, no network: a 512-rank layout
of a 6.7B model checks in seconds. The pipeline schedule is not built: its shape inference sends tensors,
which a fake group cannot carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nanotron.config import Config
from nanotron.parallel.mesh import build_mesh, expert_mesh
from nanotron.plan.memory import param_bytes


@dataclass
class RankCheck:
    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    cp_rank: int
    built_bytes: int  # fp32 bytes of the local parameter shards of the model really built
    formula_bytes: int  # what `nanotron.plan.memory.param_bytes` says for the same coordinates


@dataclass
class _Coordinates:
    """What `parallelize` needs of a ParallelContext."""

    mesh: object
    pp_rank: int
    cp_rank: int
    expert_mesh: object = None
    device: torch.device = torch.device("cpu")


def rank_of(cfg: Config, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
    """Global rank of mesh coordinates (row-major over pp, dp, cp, tp; HSDP's flattened dp is the same order)."""
    p = cfg.parallelism
    return ((pp_rank * p.dp + dp_rank) * p.cp + cp_rank) * p.tp + tp_rank


def distinct_ranks(cfg: Config) -> list[tuple[int, int, int, int]]:
    """(pp, dp, tp, cp) coordinates to build: for every pipeline rank, the first and the last dp/cp/tp
    coordinates, which hold the largest and the smallest chunks when a dimension does not divide evenly."""
    p = cfg.parallelism
    coords = []
    for pp_rank in range(p.pp):
        for dp_rank, tp_rank, cp_rank in {(0, 0, 0), (p.dp - 1, p.tp - 1, p.cp - 1)}:
            coords.append((pp_rank, dp_rank, tp_rank, cp_rank))
    return sorted(coords)


def check_ranks(cfg: Config) -> list[RankCheck]:
    """Builds each distinct rank on a fake process group of cfg.world_size ranks."""
    from nanotron.parallel.parallelize import parallelize
    from nanotron.parallel.torch_private import fake_process_group

    if dist.is_initialized():
        raise RuntimeError("nanotron plan --check needs a process without a process group")
    results = []
    for pp_rank, dp_rank, tp_rank, cp_rank in distinct_ranks(cfg):
        rank = rank_of(cfg, pp_rank, dp_rank, tp_rank, cp_rank)
        fake_process_group(rank, cfg.world_size)
        try:
            mesh = build_mesh(cfg, "cpu")
            cp = mesh["cp"].get_local_rank() if cfg.parallelism.cp > 1 else 0
            experts = expert_mesh(mesh, cfg.parallelism.ep)
            built = parallelize(cfg, _Coordinates(mesh, mesh["pp"].get_local_rank(), cp, experts))
            total = 0
            for _, module in built:
                for param in module.parameters():
                    local = param.to_local() if isinstance(param, DTensor) else param
                    total += local.numel() * local.element_size()
        finally:
            dist.destroy_process_group()
        shard_rank = (dp_rank % cfg.dp_shard_size) * cfg.parallelism.cp + cp_rank
        formula = param_bytes(cfg, pp_rank, tp_rank, shard_rank)
        results.append(RankCheck(rank, pp_rank, tp_rank, dp_rank, cp_rank, total, formula))
    return results
