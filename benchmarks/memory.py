"""What each rank holds per layout, measured, against the one-process run and against `nanotron plan`.

    python -m benchmarks.memory [--size small] [--quick]

Each layout is a real run: torchrun starts the ranks, each builds nanotron's `Trainer` exactly as
`python -m nanotron.train` does and trains two steps of 8 microbatches per rank under `benchmarks/probe.py`,
which measures what the rank holds: parameter shards and optimizer state (a DTensor counts its local
shard), the gradients held at any point between microbatches (shards plus FSDP's unsharded accumulation
buffers), the activations autograd saves for backward (peak over the step, all in-flight microbatches)
and FSDP's gathered working copies. Each is compared with `nanotron.plan.memory.stage_memory` for the same
config and pipeline rank (`*_err` = estimate / measured - 1, the worst rank). Peak memory is the device's
peak allocation on GPU; on CPU the peak resident set size, also shown as growth over the rank's size
before it built anything (the Python runtime and libraries are ~0.4 GiB per process).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    QUIET_RUN,
    REPO,
    RESULTS_DIR,
    bench_env,
    bench_parser,
    ensure_data,
    model_overrides,
    parse_or_work,
    write_table,
)

MIB = 2**20
MICROBATCHES = 8
# (name, overrides, target ratio of the largest rank's state bytes to the one-process total, or None).
LAYOUTS: list[tuple[str, list[str], float | None]] = [
    ("1 process", [], None),
    ("dp2 zero0", ["--parallelism.dp=2", "--parallelism.zero_stage=0"], None),
    ("dp2 zero1", ["--parallelism.dp=2", "--parallelism.zero_stage=1"], None),
    ("dp2 zero2", ["--parallelism.dp=2", "--parallelism.zero_stage=2"], 0.55),
    ("dp2 zero3", ["--parallelism.dp=2", "--parallelism.zero_stage=3"], 0.55),
    ("dp4 hsdp2x2 zero2", ["--parallelism.dp=4", "--parallelism.dp_shard=2", "--parallelism.zero_stage=2"], 0.55),
    ("tp2 reduce_scatter", ["--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter"], 0.55),
    ("tp2 all_reduce", ["--parallelism.tp=2", "--parallelism.tp_mode=all_reduce"], 0.55),
    ("tp4 reduce_scatter", ["--parallelism.tp=4", "--parallelism.tp_mode=reduce_scatter"], 0.3),
    ("pp2 1f1b", ["--parallelism.pp=2"], 0.6),
    ("pp2 1f1b dp2 zero2", ["--parallelism.pp=2", "--parallelism.dp=2", "--parallelism.zero_stage=2"], 0.3),
    ("pp2 afab", ["--parallelism.pp=2", "--parallelism.pp_engine=afab"], None),
    ("pp2 interleaved_1f1b", ["--parallelism.pp=2", "--parallelism.pp_engine=interleaved_1f1b"], None),
    ("recompute full", ["--parallelism.recompute=full"], None),
    ("recompute selective", ["--parallelism.recompute=selective"], None),
    (
        "recompute selective every_other",
        ["--parallelism.recompute=selective", "--parallelism.selective_matmuls=every_other"],
        None,
    ),
    ("tp2 recompute selective", ["--parallelism.tp=2", "--parallelism.recompute=selective"], None),
    ("tp4 recompute selective", ["--parallelism.tp=4", "--parallelism.recompute=selective"], None),
    ("bf16 dp2 zero1", ["--training.dtype=bfloat16", "--parallelism.dp=2", "--parallelism.zero_stage=1"], None),
    ("dp2 tp2 zero3", ["--parallelism.dp=2", "--parallelism.tp=2", "--parallelism.zero_stage=3"], None),
    (
        "dp2 tp2 pp2 zero3",
        ["--parallelism.dp=2", "--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.zero_stage=3"],
        None,
    ),
]
QUICK_LAYOUTS = ("1 process", "dp2 zero3")
COLUMNS = (
    "layout",
    "world",
    "param_mib",
    "grad_mib",
    "optimizer_mib",
    "state_mib",
    "vs_1_process",
    "target",
    "met",
    "activation_mib",
    "working_mib",
    "param_err",
    "grad_err",
    "optimizer_err",
    "activation_err",
    "working_err",
    "rank_state_mib",
    "peak_gib",
    "peak_growth_gib",
)
# (record key, plan parts whose sum estimates it, table column)
ESTIMATED = (
    ("param_bytes", ("params",), "param_err"),
    ("grad_bytes", ("grads",), "grad_err"),
    ("optimizer_bytes", ("optimizer",), "optimizer_err"),
    ("activation_bytes", ("activations_saved", "logits_saved"), "activation_err"),
    ("working_bytes", ("working",), "working_err"),
)


def world_of(overrides: list[str]) -> int:
    world = 1
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in ("--parallelism.dp", "--parallelism.cp", "--parallelism.tp", "--parallelism.pp"):
            world *= int(value)
    return world


def resident_gib() -> float:
    """This process's current resident set (Linux /proc), the baseline that peak RSS is compared with."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def worker(args: list[str], out: Path) -> None:
    """One rank: train with the real Trainer under the probe, count what this rank holds, rank 0 writes all."""
    import torch
    import torch.distributed as dist

    from benchmarks.probe import StepProbe, nbytes, pipeline_buffer_bytes
    from nanotron.config import load_config, parse_overrides
    from nanotron.launch.torchrun import launched_world_size
    from nanotron.metrics.step import memory_record
    from nanotron.parallel.mesh import destroy_distributed
    from nanotron.parallel.recompute import recompute_mode
    from nanotron.trainer import Trainer

    baseline = resident_gib() if not torch.cuda.is_available() else 0.0
    cfg = load_config(*parse_overrides(args), world_size=launched_world_size())
    trainer = Trainer(cfg)
    with StepProbe(trainer.modules, functools.partial(recompute_mode, cfg)).active() as probe:
        trainer.train()
    optimizer_state = [
        value
        for optimizer in trainer.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    ]
    peak = memory_record(trainer.ctx.device)["memory_gib"]
    record = {
        "rank": trainer.ctx.rank,
        "pp_rank": trainer.ctx.pp_rank,
        "param_bytes": sum(nbytes(p) for p in trainer.params),
        "grad_bytes": probe.grad_peak,
        "optimizer_bytes": sum(nbytes(v) for v in optimizer_state),
        "activation_bytes": probe.activation_peak,
        "working_bytes": probe.working_peak,
        "pipeline_buffer_bytes": pipeline_buffer_bytes(trainer.runner.schedule),
        "peak_gib": peak,
        "peak_growth_gib": peak - baseline,
    }
    records = [record]
    if dist.is_initialized():
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
    if trainer.ctx.rank == 0:
        out.write_text(json.dumps(records))
    trainer.close()
    destroy_distributed()


def measure(name: str, overrides: list[str], base_args: list[str], work_dir: Path) -> list[dict]:
    """Per-rank records of one layout, from a fresh (torchrun) launch of the worker."""
    world = world_of(overrides)
    out = work_dir / "runs" / f"memory-{name.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd = [
        *(launcher if world > 1 else [sys.executable]),
        "-m",
        "benchmarks.memory",
        "--worker",
        "--out",
        str(out),
        *base_args,
        *overrides,
        f"--job.out_dir={work_dir / 'runs'}",
        f"--job.name=memory-{name.replace(' ', '_')}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"layout '{name}' failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def estimate_errors(ranks: list[dict], args: list[str]) -> dict[str, float]:
    """The plan's estimate for each rank's pipeline stage against what that rank measured: the worst
    relative error per part over all ranks."""
    from nanotron.config import load_config, parse_overrides
    from nanotron.plan.memory import stage_memory

    cfg = load_config(*parse_overrides(args))
    estimates = {r: stage_memory(cfg, r) for r in range(cfg.parallelism.pp)}
    errors = {}
    for key, parts, column in ESTIMATED:
        relative = [
            sum(estimates[rank["pp_rank"]][part] for part in parts) / rank[key] - 1 for rank in ranks if rank[key]
        ]
        errors[column] = max(relative, key=abs) if relative else 0.0
    return errors


def summarize(name: str, target: float | None, ranks: list[dict], reference_bytes: int, args: list[str]) -> dict:
    """One table row: the largest rank's state (what must fit on a device) against the one-process total."""
    state = [r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in ranks]
    top = ranks[max(range(len(ranks)), key=state.__getitem__)]
    ratio = max(state) / reference_bytes
    return {
        "layout": name,
        "world": len(ranks),
        "param_mib": top["param_bytes"] / MIB,
        "grad_mib": top["grad_bytes"] / MIB,
        "optimizer_mib": top["optimizer_bytes"] / MIB,
        "state_mib": max(state) / MIB,
        "vs_1_process": ratio,
        "target": f"<= {target}" if target else "",
        "met": ("yes" if ratio <= target else "NO") if target else "",
        "activation_mib": max(r["activation_bytes"] for r in ranks) / MIB,
        "working_mib": max(r["working_bytes"] for r in ranks) / MIB,
        **estimate_errors(ranks, args),
        "rank_state_mib": " ".join(f"{s / MIB:.1f}" for s in state),
        "peak_gib": max(r["peak_gib"] for r in ranks),
        "peak_growth_gib": max(r["peak_growth_gib"] for r in ranks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("memory", __doc__)
    parser.add_argument("--size", default="small", help="a benchmarks.common.MODELS key")
    parser.add_argument("--quick", action="store_true", help="smoke-test settings: nano model, four layouts")
    parser.add_argument("--layouts", nargs="+", metavar="NAME", help="only these layouts (names as in the table)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for memory.csv/.md (a worker's JSON)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="synthetic data and run dirs")
    args = parse_or_work(parser, argv, worker)
    size = "nano" if args.quick else args.size
    layouts = [layout for layout in LAYOUTS if not args.quick or layout[0] in QUICK_LAYOUTS]
    selective = [name for name, flags, _ in layouts if "--parallelism.recompute=selective" in flags]
    if selective:
        import torch

        from nanotron.parallel.recompute import POLICY_SEES_OUTPUTS

        if not POLICY_SEES_OUTPUTS:
            print(
                f"skipped (torch {torch.__version__} hides what selective recompute keeps from the probe): {selective}"
            )
            layouts = [layout for layout in layouts if layout[0] not in selective]
    if args.layouts:  # the one-process run stays first: it is the reference
        unknown = set(args.layouts) - {name for name, _, _ in LAYOUTS}
        if unknown:
            parser.error(f"--layouts: unknown {sorted(unknown)}; expected names from: {[n for n, _, _ in LAYOUTS]}")
        layouts = [layout for layout in layouts if layout[0] in {"1 process", *args.layouts}]
    base_args = [
        *QUIET_RUN,
        *ensure_data(args.work_dir),
        *model_overrides(size),
        "--training.steps=2",
        "--training.micro_batch_size=2",
        f"--training.grad_accum_steps={MICROBATCHES}",
        "--training.global_batch_size=0",
    ]
    rows, reference = [], 0
    for name, overrides, target in layouts:
        ranks = measure(name, overrides, base_args, args.work_dir)
        if not reference:  # the first layout is the single process
            reference = sum(ranks[0][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        rows.append(summarize(name, target, ranks, reference, [*base_args, *overrides]))
        print(f"  {name:20s} state {rows[-1]['state_mib']:8.1f} MiB/rank  x{rows[-1]['vs_1_process']:.3f}", flush=True)
    print(f"model size '{size}'")
    print(write_table(rows, COLUMNS, args.out / "memory"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
