"""Throughput of nanotron across layouts, speed features and model sizes, from real training runs.

    python -m benchmarks.throughput [--sizes tiny,small] [--steps 8] [--repeats 2] [--quick]

Every row is a fresh `python -m nanotron.train` (under torchrun when world > 1). The global batch is
the same for every layout (same math, contract 1): one microbatch per dp rank, except pipeline layouts
and names ending in "mbN", which split it into 8 (N) microbatches. From each run's metrics.jsonl the
median over the steps after warm-up is taken; rounds are interleaved and the best (lowest step time)
round counts, which filters out other load on shared cores. Speedup is tokens/s over the one-process
row of the same size; scaling efficiency is speedup / world. MFU uses one peak per device for every
row: nanotron's GPU table on GPU; on CPU the best one-thread matmul probe (per dtype) of the sweep.
Writes throughput.csv, throughput.md and throughput.png (matplotlib, the `bench` extra) to --out.
`--profile DIR` adds nanotron's profiler to every run (read with `python -m benchmarks.trace_summary`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    QUIET_RUN,
    RESULTS_DIR,
    bench_parser,
    collect_metrics,
    ensure_data,
    launch_nanotron,
    markdown_table,
    median_after_warmup,
    model_overrides,
    write_table,
)


@dataclass(frozen=True)
class Layout:
    name: str
    overrides: tuple[str, ...] = ()
    microbatches: int = 1  # per dp rank per step (grad_accum_steps; pipeline microbatches)
    copies: int = 1  # independent runs started together, each with 1/copies of the batch (no communication)

    @property
    def ranks(self) -> int:
        """Processes of one run: dp * tp * pp."""
        ranks = 1
        for arg in self.overrides:
            key, _, value = arg.partition("=")
            if key in ("--parallelism.dp", "--parallelism.tp", "--parallelism.pp"):
                ranks *= int(value)
        return ranks

    @property
    def world(self) -> int:
        return self.ranks * self.copies

    @property
    def dp(self) -> int:
        return next((int(a.partition("=")[2]) for a in self.overrides if a.startswith("--parallelism.dp=")), 1)


BASELINE = "1 process"
LAYOUTS = (
    Layout(BASELINE),
    Layout("1 process mb8", microbatches=8),
    # The machine's ceiling for any 2-rank layout: two runs at once share cores, caches and memory bandwidth.
    Layout("2 independent processes", copies=2),
    Layout("dp2 zero0", ("--parallelism.dp=2", "--parallelism.zero_stage=0")),
    Layout("dp2 zero1", ("--parallelism.dp=2", "--parallelism.zero_stage=1")),
    Layout("dp2 zero3", ("--parallelism.dp=2", "--parallelism.zero_stage=3")),
    Layout("dp2 zero0 mb4", ("--parallelism.dp=2", "--parallelism.zero_stage=0"), microbatches=4),
    Layout("tp2 reduce_scatter", ("--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter")),
    Layout("tp2 all_reduce", ("--parallelism.tp=2", "--parallelism.tp_mode=all_reduce")),
    Layout("pp2 1f1b", ("--parallelism.pp=2", "--parallelism.pp_engine=1f1b"), microbatches=8),
    Layout("pp2 afab", ("--parallelism.pp=2", "--parallelism.pp_engine=afab"), microbatches=8),
    Layout("pp2 interleaved_1f1b", ("--parallelism.pp=2", "--parallelism.pp_engine=interleaved_1f1b"), microbatches=8),
    Layout("recompute", ("--parallelism.recompute=full",)),
    Layout("recompute selective", ("--parallelism.recompute=selective",)),
    Layout(
        "recompute selective every_other",
        ("--parallelism.recompute=selective", "--parallelism.selective_matmuls=every_other"),
    ),
    Layout("bf16", ("--training.dtype=bfloat16",)),
    Layout("compile", ("--training.compile=true",)),
    Layout("fused AdamW off", ("--optimizer.fused=false",)),
)
QUICK_LAYOUTS = (BASELINE, "dp2 zero0")
# (layout, baseline layout, the speedup it must reach): the scaling targets of the benchmark issue. The
# pipeline is compared with pp=1 at the same 8 microbatches (nanotron's n_microbatches = grad_accum_steps),
# so only the pipeline's own costs (bubble, stage imbalance, p2p) count, not the smaller matmuls.
TARGETS = (("dp2 zero0", BASELINE, 1.8), ("pp2 1f1b", "1 process mb8", 1.6))
COLUMNS = (
    "size",
    "layout",
    "world",
    "microbatches",
    "step_time_sec",
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "tflops",
    "mfu",
    "speedup",
    "efficiency",
    "memory_gib",
    "round_step_times",
    "load",
)


def cpu_peak_tflops(dtype_name: str, size: int = 1024, seconds: float = 0.3) -> float:
    """One core's best matmul rate over a few probes: the MFU denominator of every CPU row.

    A 1024^3 matmul reaches the core's sustained rate; smaller probes (nanotron's per-run 512^3 one)
    read low on this machine, which would overstate MFU.
    """
    import time

    import torch

    torch.set_num_threads(1)
    a = torch.randn(size, size, dtype=torch.bfloat16 if dtype_name == "bfloat16" else torch.float32)
    rates = []
    for _ in range(3):
        torch.mm(a, a)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            torch.mm(a, a)
            n += 1
        rates.append(2 * size**3 * n / (time.perf_counter() - start) / 1e12)
    return max(rates)


def layout_args(layout: Layout, size: str, steps: int, global_batch: int, common: list[str]) -> list[str]:
    """The run's overrides; the same global batch for every layout, split over dp ranks and microbatches."""
    global_batch //= layout.copies
    micro_batch = global_batch // (layout.dp * layout.microbatches)
    return [
        *QUIET_RUN,
        *common,
        *model_overrides(size),
        *layout.overrides,
        f"--training.steps={steps}",
        f"--training.global_batch_size={global_batch}",
        f"--training.micro_batch_size={micro_batch}",
        "--training.grad_accum_steps=0",
    ]


def run_dtype(args: list[str]) -> str:
    """training.dtype of a run: the last override wins, as in nanotron's parser."""
    return next(a.partition("=")[2] for a in reversed(args) if a.startswith("--training.dtype="))


def summarize_run(records: list[dict], warmup: int) -> dict:
    """Medians over the steady-state steps of one run (memory: the largest value seen)."""
    steady = records[warmup:] or records
    row = {
        key: statistics.median(r[key] for r in steady)
        for key in ("step_time_sec", "tokens_per_sec", "tokens_per_sec_per_device", "tflops", "mfu")
    }
    row["step_time_sec"] = median_after_warmup([r["step_time_sec"] for r in records], warmup)
    row["memory_gib"] = max(r["memory_gib"] for r in records)
    return row


def run_layout(layout: Layout, name: str, args: list[str], work_dir: Path, steps: int, warmup: int) -> dict:
    """One measurement: a run, or the layout's independent copies started together (throughput summed)."""
    names = [name] if layout.copies == 1 else [f"{name}-{i}" for i in range(layout.copies)]
    launched = [launch_nanotron(run_name, args, layout.ranks, work_dir) for run_name in names]
    parts = [summarize_run(collect_metrics(*run, steps), warmup) for run in launched]
    return {
        "step_time_sec": max(p["step_time_sec"] for p in parts),
        "tokens_per_sec": sum(p["tokens_per_sec"] for p in parts),
        "tokens_per_sec_per_device": statistics.mean(p["tokens_per_sec_per_device"] for p in parts),
        "tflops": statistics.mean(p["tflops"] for p in parts),
        "mfu": statistics.mean(p["mfu"] for p in parts),
        "memory_gib": max(p["memory_gib"] for p in parts),
    }


def sweep(layouts: list[Layout], settings: argparse.Namespace) -> list[dict]:
    """Runs every (size, layout) once per round (settings: the parsed command line); keeps the fastest round."""
    sizes, steps, warmup, repeats = settings.sizes.split(","), settings.steps, settings.warmup, settings.repeats
    common = [
        *ensure_data(settings.work_dir),
        f"--training.device={settings.device}",
        f"--training.dtype={settings.dtype}",
    ]
    cpu = settings.device == "cpu" or (settings.device == "auto" and not _cuda_available())
    if cpu:  # nanotron's MFU = tflops / 1 (no per-run probe); the real MFU is computed below
        common.append("--logging.peak_tflops=1")
    peaks: dict[str, float] = {}
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(repeats):
        if cpu:  # a probe per round, keeping the best: one taken during a burst of other load reads low
            peaks = {name: max(peaks.get(name, 0.0), cpu_peak_tflops(name)) for name in ("float32", "bfloat16")}
            print(
                f"CPU peak per device (1 thread, best so far): fp32 {peaks['float32']:.3f}, "
                f"bf16 {peaks['bfloat16']:.3f} TFLOP/s",
                flush=True,
            )
        for size in sizes:
            for layout in layouts:
                load = os.getloadavg()[0]
                args = layout_args(layout, size, steps, settings.global_batch, common)
                name = f"throughput-{size}-{layout.name}".replace(" ", "_").replace(",", "")
                if settings.profile:
                    args.append(f"--profiler.export_path={settings.profile / name}")
                result = run_layout(layout, name, args, settings.work_dir, steps, warmup) | {"load": load}
                if cpu:
                    result["dtype"] = run_dtype(args)
                runs.setdefault((size, layout.name), []).append(result)
                print(
                    f"  round {round_index + 1}/{repeats} {size:6s} {layout.name:28s} "
                    f"{result['step_time_sec']:.4f} s/step  {result['tokens_per_sec']:8.0f} tokens/s  "
                    f"(load {load:.1f})",
                    flush=True,
                )
    for results in runs.values():
        for result in results:
            if cpu:
                result["mfu"] = result["tflops"] / peaks[result.pop("dtype")]
    rows = []
    for size in sizes:
        for layout in layouts:
            results = runs[size, layout.name]
            best = min(results, key=lambda r: r["step_time_sec"])
            rows.append(
                {
                    "size": size,
                    "layout": layout.name,
                    "world": layout.world,
                    "microbatches": layout.microbatches,
                    **best,
                    "round_step_times": " ".join(f"{r['step_time_sec']:.4f}" for r in results),
                }
            )
        base = next(r for r in rows if r["size"] == size and r["layout"] == BASELINE)
        for row in rows:
            if row["size"] == size:
                row["speedup"] = row["tokens_per_sec"] / base["tokens_per_sec"]
                row["efficiency"] = row["speedup"] / row["world"]
    return rows


def target_lines(rows: list[dict]) -> list[str]:
    """One verdict line per scaling target and model size present in the sweep."""
    lines = []
    by_key = {(r["size"], r["layout"]): r for r in rows}
    for size in dict.fromkeys(r["size"] for r in rows):
        for layout, baseline, target in TARGETS:
            if (size, layout) in by_key and (size, baseline) in by_key:
                ratio = by_key[size, layout]["tokens_per_sec"] / by_key[size, baseline]["tokens_per_sec"]
                verdict = "met" if ratio >= target else "MISSED"
                lines.append(f"{size}: {layout} tokens/s = {ratio:.3f} x '{baseline}' (target >= {target}): {verdict}")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """Scaling efficiency per layout, one bar per model size; skipped (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    width = 0.8 / len(sizes)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(layouts) + 2), 4.5))
    for i, size in enumerate(sizes):
        by_layout = {r["layout"]: r["efficiency"] for r in rows if r["size"] == size}
        xs = [j + (i - (len(sizes) - 1) / 2) * width for j in range(len(layouts))]
        ax.bar(xs, [by_layout.get(name, 0.0) for name in layouts], width, label=size)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(layouts)), layouts, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("scaling efficiency\n(tokens/s per device / 1 process)")
    ax.set_title("nanotron throughput by layout")
    ax.legend(title="model")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("throughput", __doc__)
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated benchmarks.common.MODELS keys")
    parser.add_argument(
        "--layouts", default="", help="comma-separated layout names (default: all; '1 process' is always added)"
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (best round counts)")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step, every layout")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="training.device of runs")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="training.dtype of runs")
    parser.add_argument(
        "--profile",
        type=Path,
        help="also write torch.profiler traces (profiler.export_path) of every run here; profiled runs are slower",
    )
    parser.add_argument("--quick", action="store_true", help="smoke-test settings: nano model, 2 layouts, 3 steps")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for throughput.csv/.md/.png")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="synthetic data and run dirs")
    args = parser.parse_args(argv)
    wanted = set(args.layouts.split(",")) if args.layouts else {layout.name for layout in LAYOUTS}
    if args.quick:
        args.sizes, args.steps, args.warmup, args.repeats, wanted = "nano", 3, 1, 1, set(QUICK_LAYOUTS)
    wanted.add(BASELINE)  # every speedup is relative to it
    layouts = [layout for layout in LAYOUTS if layout.name in wanted]
    unknown = wanted - {layout.name for layout in LAYOUTS}
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {[layout.name for layout in LAYOUTS]}")
    rows = sweep(layouts, args)
    lines = target_lines(rows)
    markdown = write_table(rows, COLUMNS, args.out / "throughput")
    if lines:
        (args.out / "throughput.md").write_text(markdown + "\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    plot(rows, args.out / "throughput.png")
    print(markdown_table(rows, [c for c in COLUMNS if c not in ("round_step_times", "load")]))
    print("\n".join(lines))
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
