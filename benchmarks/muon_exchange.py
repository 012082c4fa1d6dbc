"""Muon's exchange at a real layout, counted on its real routes: what one rank sends and receives in the step's
two all-to-alls and the Newton-Schulz FLOPs it owns, next to `nanotron plan`'s formula.

    python -m benchmarks.muon_exchange                  # Llama-70B shapes, tp 8 x FSDP 64 (zero 3): 512 ranks
    python -m benchmarks.muon_exchange --rank 511       # another rank of it
    python -m benchmarks.muon_exchange --quick          # one tiny layer at tp 2 x FSDP 4 (7 matrices, 8 ranks)

The rank's model is built on torch's fake process group at the full world size (meta device, as `nanotron plan
--check`); every other rank's blocks come from its mesh coordinates (`torch_private.shard_block_at`), so the
routes are the ones `optim.muon.Plan` builds in training. Nothing moves: these are counts, not timings.
Writes muon_exchange.csv/.md to --out.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import REPO, bench_parser, write_table

LLAMA_70B = [
    "--model.hidden_size=8192",
    "--model.intermediate_size=28672",
    "--model.num_layers=80",
    "--model.num_heads=64",
    "--model.num_kv_heads=8",
    "--model.vocab_size=128256",
    "--model.max_seq_len=8192",
    "--training.seq_len=8192",
    "--training.micro_batch_size=1",
    "--training.global_batch_size=512",
    "--training.grad_accum_steps=0",
    "--training.dtype=bfloat16",
    "--parallelism.dp=64",
    "--parallelism.tp=8",
    "--parallelism.pp=1",
    "--parallelism.zero_stage=3",
    "--parallelism.recompute=full",
]
QUICK = [  # one layer: 7 matrices over 8 ranks, so the busiest owner holds more than the average
    "--model.size=tiny",
    "--model.num_layers=1",
    "--training.micro_batch_size=1",
    "--training.global_batch_size=8",
    "--training.grad_accum_steps=0",
    "--parallelism.dp=4",
    "--parallelism.tp=2",
    "--parallelism.zero_stage=3",
]
COLUMNS = ("layout", "rank", "ranks", "matrices_owned", "sent_mb", "received_mb", "plan_sent_mb", "ns_gflop")


def count(overrides: list[str], rank: int) -> dict:
    """The routes of `rank` (pipeline stage 0's ranks: pp 1 here) in bytes and FLOPs."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nanotron.config import load_config, parse_overrides
    from nanotron.optim.muon import Plan, is_muon_matrix, newton_schulz_flops, numel
    from nanotron.parallel.mesh import build_mesh
    from nanotron.parallel.parallelize import parallelize
    from nanotron.parallel.torch_private import fake_process_group, submesh
    from nanotron.plan.check import _Coordinates
    from nanotron.plan.timing import muon_step, parse_gpu

    cfg = load_config(*parse_overrides([*overrides, "--optimizer.name=muon"]))
    if cfg.parallelism.pp != 1:
        raise SystemExit("muon_exchange: pp 1 layouts only (each stage's exchange is its own)")
    fake_process_group(rank, cfg.world_size)
    try:
        mesh = build_mesh(cfg, "cpu")
        [(_, module)] = parallelize(cfg, _Coordinates(mesh, 0, 0, None))
        o = cfg.optimizer
        named = [(n, p) for n, p in module.named_parameters() if is_muon_matrix(n, p.ndim, o.muon_adamw_names)]
        stage_mesh = submesh(mesh, "stage")
        group, stage = stage_mesh.get_group(), stage_mesh.mesh.flatten().tolist()
        coordinates: dict = {}
        blocks = [[block_of(p, global_rank, coordinates) for _, p in named] for global_rank in stage]
        plan = Plan([n for n, _ in named], [p for _, p in named], group, blocks)
        bytes_ = 4  # fp32 momentum and updates
        others = [r for r in range(plan.size) if r != plan.rank]
        sent = sum(numel_of(index, named[i][1]) for r in others for i, index in plan.outgoing[r])
        sent += sum(numel(index) for r in others for _, index in plan.back[r])
        received = sum(plan.incoming_sizes[r] + plan.returning_sizes[r] for r in others)
        flops = sum(newton_schulz_flops(*m.shape, o.muon_ns_steps) for m in plan.owned)
        plan_mb = muon_step(cfg, 8, parse_gpu("h100"), 1.0)[0].gb * 1e3  # what `nanotron plan` charges
        assert all(isinstance(p, DTensor) for _, p in named)
    finally:
        dist.destroy_process_group()
    p = cfg.parallelism
    return {
        "layout": f"dp{p.dp} tp{p.tp} zero{p.zero_stage}",
        "rank": rank,
        "ranks": plan.size,
        "matrices_owned": f"{len(plan.owned)} of {len(plan.matrices)}",
        "sent_mb": round(bytes_ * sent / 1e6, 3),
        "received_mb": round(bytes_ * received / 1e6, 3),
        "plan_sent_mb": round(plan_mb, 3),
        "ns_gflop": round(flops / 1e9, 1),
    }


def block_of(param, global_rank: int, coordinates: dict) -> tuple:
    """The block the rank `global_rank` holds of `param`, from its coordinate on the parameter's mesh (each mesh's
    coordinates computed once: `DeviceMesh.mesh` is slow to read)."""
    from nanotron.parallel.torch_private import shard_block_at

    mesh = param.device_mesh
    if id(mesh) not in coordinates:
        grid = mesh.mesh
        coordinates[id(mesh)] = {int(grid[tuple(c)]): c.tolist() for c in (grid >= 0).nonzero()}
    where = coordinates[id(mesh)].get(global_rank)
    if where is None:
        raise SystemExit("muon_exchange: a parameter's mesh does not span the stage (a replicated dim): not counted")
    return shard_block_at(param, where)


def numel_of(index, param) -> int:
    """Elements of a local-shard index (ints, then a row slice, then every column)."""
    rows = index[-2]
    return (rows.stop - rows.start) * param.to_local().shape[-1]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("muon_exchange", __doc__)
    parser.add_argument("--rank", type=int, default=0, help="the rank to count (default 0)")
    parser.add_argument("--quick", action="store_true", help="one tiny layer at tp 2 x FSDP 4")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "muon_exchange", help="folder for the table")
    parser.add_argument("--work-dir", type=Path, default=None, help="unused: the benchmarks' common flag")
    settings = parser.parse_args(argv)
    row = count(QUICK if settings.quick else LLAMA_70B, settings.rank)
    settings.out.mkdir(parents=True, exist_ok=True)
    print(write_table([row], COLUMNS, settings.out / "muon_exchange"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
