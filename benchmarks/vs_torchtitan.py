"""nanotron beside torchtitan 0.2.2 on this CPU: tokens/s and peak RSS per layout, as ratios this/torchtitan.

    python -m benchmarks.vs_torchtitan [--layouts "1 process,tp2 sp"] [--rounds 5] [--steps 20] [--quick]
    python -m benchmarks.vs_torchtitan --from-runs benchmarks/results/vs_torchtitan_runs.csv [--target 1.05]

Not in CI (minutes per run; it needs torchtitan, an opt-in extra). Install it into the venv `make setup` made,
beside the project's torch, and check that torch is still the one you had (torchtitan 0.2.2 names no torch;
torchdata asks torch>=2, which the installed one satisfies, so pip keeps it):
    .venv/bin/pip install -e ".[titan]"        # torchtitan==0.2.2 and triton (imported by torchtitan, CPU too)
    .venv/bin/python -c "import torch; print(torch.__version__)"   # unchanged (2.13.0+cpu here)
If pip ever wants another torch, install with --no-deps instead: torchtitan==0.2.2 triton torchdata, then
`pip install tyro einops tomli` (the rest of its dependencies are the project's own).

Both tools train torchtitan's llama3 `debugmodel` (dim 256, 6 layers, 16 heads, vocab 2048, FFN 768: 6.16M
parameters) on sequences of 512 tokens in fp32 with the same global batch (8), fused AdamW, gradient clipping
at 1.0, no activation checkpointing, no compile, no evaluation and no checkpoints, each from the same local
synthetic corpus (torchtitan tokenizes it as it reads, with the same local tokenizer; nanotron memory-maps its
tokenized copy). Both start under torchrun with one math thread per rank and gloo. torchtitan as published
does not run on a CPU: it picks "cuda" when no accelerator is present, and its FSDP gradient sum uses an op
gloo lacks. `titan_worker` adapts both without changing any arithmetic; nothing else of torchtitan changes.

Layouts (the same on both sides): 1 process; FSDP2 dp2 (nanotron zero_stage 3, torchtitan's dp_shard 2 with
fp32 parameters); TP2 with sequence parallelism (nanotron tp_mode reduce_scatter, torchtitan's TP, which
always shards the norms' sequence); PP2 1F1B with 8 microbatches of 1; FSDP2 dp2 x TP2.

Measures, per run (a fresh torchrun): tokens/s from the tool's own step log (nanotron's metrics.jsonl
`tokens_per_sec`; torchtitan's `tps`, which is per device, times the world size), the median after the
warm-up steps; peak RSS as the largest `ru_maxrss` of any process of the run (`os.wait4` on torchrun: the
kernel folds each rank's peak into it), i.e. the fattest rank (the harness's own RSS, inherited at the
fork, is ~50 MiB: it never imports torch). Rounds interleave the tools, the one going
first alternating per round, so load drifting on shared cores hits both alike; each layout's row gives
the ratio this/torchtitan per round as median [min-max], with the verdict against --target (1.05): met or missed
only when the sign test's 90 % interval of the median ratio (5 rounds: [min, max] at 94 %) lies wholly on one side.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    QUIET_RUN,
    REPO,
    RESULTS_DIR,
    bench_env,
    bench_parser,
    data_overrides,
    median_after_warmup,
    synthetic_data,
    torchrun_command,
    write_csv,
    write_table,
)

TOOLS = ("nanotron", "torchtitan")
CONFIDENCE = 0.9  # of the median ratio's interval behind each layout's verdict
SEQ_LEN = 512
# torchtitan's llama3 "debugmodel" in nanotron's keys (its FFN: 4*256*2/3 rounded up to a multiple of 256).
NANOTRON_MODEL = [
    "--model.hidden_size=256",
    "--model.intermediate_size=768",
    "--model.num_layers=6",
    "--model.num_heads=16",
    "--model.num_kv_heads=16",
    "--model.vocab_size=2048",
    "--model.rope_theta=500000",
    "--model.rms_norm_eps=1e-5",
    "--model.tie_word_embeddings=false",
    f"--model.max_seq_len={SEQ_LEN}",
    f"--training.seq_len={SEQ_LEN}",
    "--training.dtype=float32",
    "--training.clip_grad=1.0",
    "--parallelism.recompute=none",
    "--optimizer.fused=true",
    "--optimizer.lr=8e-4",  # torchtitan's; weight decay 0.1 and betas (0.9, 0.95) are both tools' defaults
]
TITAN_MODEL = [
    "--model.name=llama3",
    "--model.flavor=debugmodel",
    f"--training.seq_len={SEQ_LEN}",
    "--training.dtype=float32",
    "--training.mixed_precision_param=float32",
    "--training.max_norm=1.0",
    "--activation_checkpoint.mode=none",
    "--optimizer.implementation=fused",
    "--lr_scheduler.warmup_steps=0",
    "--metrics.log_freq=1",
    "--metrics.disable_color_printing",
]


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    nanotron: tuple[str, ...] = ()
    torchtitan: tuple[str, ...] = ()
    dp: int = 1
    microbatches: int = 1  # per dp rank per step: the pipeline's microbatches


LAYOUTS = (
    Layout("1 process", 1),
    Layout(
        "fsdp2 dp2",
        2,
        ("--parallelism.dp=2", "--parallelism.zero_stage=3"),
        ("--parallelism.data_parallel_shard_degree=2",),
        dp=2,
    ),
    Layout(
        "tp2 sp",
        2,
        ("--parallelism.tp=2", "--parallelism.tp_mode=reduce_scatter"),
        ("--parallelism.tensor_parallel_degree=2",),
    ),
    Layout(
        "pp2 1f1b",
        2,
        ("--parallelism.pp=2", "--parallelism.pp_engine=1f1b"),
        (
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.pipeline_parallel_schedule=1F1B",
            "--parallelism.pipeline_parallel_microbatch_size=1",
        ),
        microbatches=8,
    ),
    Layout(
        "fsdp2 dp2 x tp2",
        4,
        ("--parallelism.dp=2", "--parallelism.zero_stage=3", "--parallelism.tp=2"),
        ("--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2"),
        dp=2,
    ),
)
QUICK_LAYOUTS = ("1 process", "tp2 sp")
COLUMNS = (
    "layout",
    "world",
    "rounds",
    "nanotron_tokens_per_sec",
    "torchtitan_tokens_per_sec",
    "tokens_per_sec_ratio",
    "tokens_per_sec_ratio_min",
    "tokens_per_sec_ratio_max",
    "nanotron_peak_rss_mib",
    "torchtitan_peak_rss_mib",
    "peak_rss_ratio",
    "peak_rss_ratio_min",
    "peak_rss_ratio_max",
    "tokens_per_sec_ratio_low",
    "tokens_per_sec_ratio_high",
    "interval_coverage",
    "verdict",
)
TITAN_STEP = re.compile(r"(?<!validate )step:\s*(\d+)\s.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def nanotron_tokens_per_sec(metrics_jsonl: str) -> list[float]:
    """Global tokens/s of each logged step, in step order, from nanotron's metrics.jsonl."""
    records = [json.loads(line) for line in metrics_jsonl.splitlines() if line.strip()]
    steps = {r["step"]: r["tokens_per_sec"] for r in records if "tokens_per_sec" in r}
    return [steps[s] for s in sorted(steps)]


def titan_tokens_per_sec(log: str, world: int) -> list[float]:
    """Global tokens/s of each logged step from torchtitan's output: its `tps` is tokens/s per device (local
    tokens over the time, divided by the non-data-parallel degree), so the run's rate is tps x world. Every
    rank logs each step with its own clock; ranks meet in collectives every step, so the median is kept."""
    steps: dict[int, list[int]] = {}
    for match in TITAN_STEP.finditer(ANSI.sub("", log)):
        steps.setdefault(int(match[1]), []).append(int(match[2].replace(",", "")))
    return [statistics.median(steps[s]) * world for s in sorted(steps)]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float] | None:
    """(low, high, coverage): the narrowest order-statistic interval that holds the median of the distribution
    the values were drawn from with probability >= `confidence`, whatever that distribution (the sign test's
    interval: the k-th smallest and k-th largest value cover it unless k or more values fall on one side,
    probability P(Binomial(n, 1/2) < k) each way). None when the values are too few: 5 rounds give [min, max]
    at 94 %, 3 rounds only 75 %."""
    n, ordered = len(values), sorted(values)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        if coverage < confidence:
            break
        best = (ordered[k - 1], ordered[n - k], coverage)
    return best


def verdict(interval: tuple[float, float, float] | None, target: float) -> str:
    """The verdict against `target`: "met" when the median ratio's interval lies at or above it, "missed" when
    below, otherwise "unsettled" (the interval straddles it, or too few rounds for one)."""
    if interval is None:
        return "unsettled"
    low, high, _ = interval
    return "met" if low >= target else "missed" if high < target else "unsettled"


def summarize(runs: list[dict], target: float = 1.05) -> list[dict]:
    """A row per layout from the runs ({layout, world, round, tool, tokens_per_sec, peak_rss_mib}): each tool's
    median over rounds and the ratio this/torchtitan of the same round, as median, min and max; the median
    ratio's distribution-free interval and the verdict against the tokens/s `target` it supports."""
    rows = []
    for layout in dict.fromkeys(r["layout"] for r in runs):
        by_round: dict[int, dict[str, dict]] = {}
        for r in runs:
            if r["layout"] == layout:
                by_round.setdefault(r["round"], {})[r["tool"]] = r
        pairs = [tools for tools in by_round.values() if set(TOOLS) <= set(tools)]
        row = {"layout": layout, "world": pairs[0]["nanotron"]["world"], "rounds": len(pairs)}
        for key, name in (("tokens_per_sec", "tokens_per_sec"), ("peak_rss_mib", "peak_rss")):
            for tool in TOOLS:
                row[f"{tool}_{key}"] = statistics.median(p[tool][key] for p in pairs)
            ratios = [p["nanotron"][key] / p["torchtitan"][key] for p in pairs]
            row[f"{name}_ratio"], row[f"{name}_ratio_min"], row[f"{name}_ratio_max"] = spread(ratios)
        interval = median_interval([p["nanotron"]["tokens_per_sec"] / p["torchtitan"]["tokens_per_sec"] for p in pairs])
        low, high, coverage = interval or (None, None, None)
        row.update(
            tokens_per_sec_ratio_low=low,
            tokens_per_sec_ratio_high=high,
            interval_coverage=coverage,
            verdict=verdict(interval, target),
        )
        rows.append(row)
    return rows


def ratio_lines(rows: list[dict], target: float) -> list[str]:
    return [
        f"{r['layout']:>16}: tokens/s this/torchtitan {r['tokens_per_sec_ratio']:.2f} "
        f"[{r['tokens_per_sec_ratio_min']:.2f}-{r['tokens_per_sec_ratio_max']:.2f}], peak RSS "
        f"{r['peak_rss_ratio']:.2f} [{r['peak_rss_ratio_min']:.2f}-{r['peak_rss_ratio_max']:.2f}] "
        f"over {r['rounds']} rounds; target {target:.2f} {r['verdict']}{interval_text(r)}"
        for r in rows
    ]


def interval_text(row: dict) -> str:
    if row["interval_coverage"] is None:
        return f" (too few rounds for an interval of the median at {CONFIDENCE:.0%}: 5 give one)"
    low, high = row["tokens_per_sec_ratio_low"], row["tokens_per_sec_ratio_high"]
    return f" (median ratio within {low:.2f}-{high:.2f} at {row['interval_coverage']:.0%})"


def batch_sizes(layout: Layout, global_batch: int) -> tuple[int, int]:
    """(per-rank batch per step, microbatch size): the same global batch split over dp ranks, then microbatches."""
    local = global_batch // layout.dp
    return local, local // layout.microbatches


def nanotron_args(layout: Layout, steps: int, global_batch: int, data: list[str]) -> list[str]:
    return [
        *QUIET_RUN,
        *data,
        *NANOTRON_MODEL,
        *layout.nanotron,
        f"--training.steps={steps}",
        f"--training.global_batch_size={global_batch}",
        f"--training.micro_batch_size={batch_sizes(layout, global_batch)[1]}",
        "--training.grad_accum_steps=0",
    ]


def titan_args(layout: Layout, steps: int, global_batch: int, corpus_dir: Path, tokenizer: Path) -> list[str]:
    return [
        *TITAN_MODEL,
        *layout.torchtitan,
        f"--model.hf_assets_path={tokenizer}",
        "--training.dataset=c4_test",  # its local-files loader: `load_dataset(path, split="train")`
        f"--training.dataset_path={corpus_dir}",
        f"--training.steps={steps}",
        f"--training.global_batch_size={global_batch}",
        f"--training.local_batch_size={batch_sizes(layout, global_batch)[0]}",
    ]


def titan_worker(args: list[str]) -> None:
    """One torchtitan rank on the CPU, with two adaptations that change no arithmetic:
    - torchtitan asks torch for the accelerator once, when `torchtitan.tools.utils` is imported
      (`_get_available_device_type() or "cuda"`), and its modules copy the answer: while torchtitan imports,
      torch answers "cpu" with a device module holding what torchtitan's trainer and memory monitor call;
    - torchtitan sums FSDP gradients itself (`set_gradient_divide_factor(1.0)`), which FSDP sends as
      PREMUL_SUM(1.0), an op gloo lacks: its FSDP modules also get `set_force_sum_reduction_for_comms`, the
      same sum as SUM.
    Its config parser reads sys.argv as it was at import (a default argument), so argv is set first."""
    sys.argv = [sys.argv[0], *args]
    import torch._utils

    asked = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: cpu_device_module()
    try:
        import torchtitan.models.llama3.infra.parallelize as titan_parallelize
        from torchtitan.train import Trainer, main
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = asked
    divide_by_one = titan_parallelize.disable_fsdp_gradient_division

    def sum_with_gloo(model: torch.nn.Module) -> None:
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, torch.distributed.fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_parallelize.disable_fsdp_gradient_division = sum_with_gloo
    main(Trainer)


def cpu_device_module() -> object:
    """torch.cpu plus the CUDA-module calls torchtitan makes: no device memory to report (RSS is measured
    outside), the machine's RAM as capacity."""
    import types

    import torch

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        **{name: getattr(torch.cpu, name) for name in ("set_device", "synchronize", "device_count", "is_available")},
        current_device=lambda: 0,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=ram),
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
        memory_stats=lambda device=None: {},
    )


RUN_COLUMNS = ("layout", "world", "round", "tool", "tokens_per_sec", "peak_rss_mib", "load")


def read_runs(path: Path) -> list[dict]:
    """The runs `write_csv` saved, with their numbers as numbers."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    kinds = {"world": int, "round": int, "tokens_per_sec": float, "peak_rss_mib": float, "load": float}
    return [{key: kinds.get(key, str)(value) if value else None for key, value in row.items()} for row in rows]


def run_and_measure(cmd: list[str], run_dir: Path, env: dict, timeout: float) -> tuple[int, float]:
    """(exit code, peak RSS in MiB of the run's largest process): torchrun waits for its ranks, so the
    kernel folds their peaks into torchrun's, which `os.wait4` returns."""
    with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return proc.returncode, usage.ru_maxrss / 1024
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd)} (logs in {run_dir})")
            time.sleep(0.2)


def run_tool(tool: str, layout: Layout, settings: argparse.Namespace, round_index: int) -> dict:
    """One fresh run of one tool in one layout: its median tokens/s after warm-up and its peak RSS."""
    corpus, tokenizer = synthetic_data(settings.work_dir)
    run_dir = settings.work_dir / "runs" / f"vs_torchtitan-{layout.name.replace(' ', '_')}-{tool}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = {**bench_env(), "HF_HOME": str(settings.work_dir / "hf_home")}
    load = os.getloadavg()[0]
    if tool == "nanotron":
        args = nanotron_args(layout, settings.steps, settings.global_batch, settings.nanotron_data)
        args += [f"--job.out_dir={run_dir}", "--job.name=run"]
        cmd = torchrun_command(layout.world, ["nanotron.train", *args])
    else:
        args = titan_args(layout, settings.steps, settings.global_batch, corpus.parent, tokenizer)
        args += [f"--job.dump_folder={run_dir / 'outputs'}"]
        cmd = torchrun_command(layout.world, ["benchmarks.vs_torchtitan", "--titan-worker", *args])
    code, rss_mib = run_and_measure(cmd, run_dir, env, settings.timeout)
    if tool == "nanotron":
        metrics = run_dir / "run" / "metrics.jsonl"
        rates = nanotron_tokens_per_sec(metrics.read_text() if metrics.is_file() else "")
    else:
        output = (run_dir / "stdout.log").read_text() + (run_dir / "stderr.log").read_text()
        rates = titan_tokens_per_sec(output, layout.world)
    if len(rates) < settings.steps:
        tail = (run_dir / "stderr.log").read_text()[-3000:]
        raise RuntimeError(f"{tool} {layout.name}: exit {code}, {len(rates)}/{settings.steps} steps logged\n{tail}")
    if code != 0:
        print(f"warning: {tool} {layout.name} exited {code} after logging every step", file=sys.stderr)
    return {
        "layout": layout.name,
        "world": layout.world,
        "round": round_index,
        "tool": tool,
        "tokens_per_sec": median_after_warmup(rates, settings.warmup),
        "peak_rss_mib": rss_mib,
        "load": load,
    }


def measure(layouts: list[Layout], settings: argparse.Namespace) -> list[dict]:
    """Interleaved rounds: every layout per round, the tool going first alternating by round."""
    runs = []
    for round_index in range(settings.rounds):
        for layout in layouts:
            tools = TOOLS if round_index % 2 == 0 else TOOLS[::-1]
            for tool in tools:
                run = run_tool(tool, layout, settings, round_index)
                runs.append(run)
                print(
                    f"  round {round_index + 1}/{settings.rounds} {layout.name:>16} {tool:>10}: "
                    f"{run['tokens_per_sec']:8.0f} tokens/s  peak RSS {run['peak_rss_mib']:6.0f} MiB",
                    flush=True,
                )
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--titan-worker"]:
        from nanotron.errors import exit_process

        titan_worker(argv[1:])
        exit_process(0)  # past its last log line: gloo's worker threads must not see interpreter teardown
    parser = bench_parser("vs_torchtitan", __doc__)
    names = [layout.name for layout in LAYOUTS]
    parser.add_argument("--layouts", default=",".join(names), help=f"comma-separated, of: {', '.join(names)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of each run's median")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--target", type=float, default=1.05, help="tokens/s ratio the verdict is against")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--quick", action="store_true", help=f"1 round of 8 steps on {', '.join(QUICK_LAYOUTS)}")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for vs_torchtitan.csv/.md")
    parser.add_argument(
        "--from-runs",
        type=Path,
        metavar="CSV",
        help="summarise the runs a measurement saved (its vs_torchtitan_runs.csv) again, e.g. at another --target",
    )
    settings = parser.parse_args(argv)
    if settings.quick:
        settings.layouts, settings.rounds, settings.steps, settings.warmup = ",".join(QUICK_LAYOUTS), 1, 8, 3
    by_name = {layout.name: layout for layout in LAYOUTS}
    unknown = [n for n in settings.layouts.split(",") if n not in by_name]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {names}")
    if settings.steps <= settings.warmup:
        parser.error("--steps must exceed --warmup")
    layouts = [by_name[n] for n in settings.layouts.split(",")]
    for layout in layouts:
        if settings.global_batch % (layout.dp * layout.microbatches):
            parser.error(f"--global-batch must divide over {layout.name}'s dp x microbatches")
    if settings.from_runs:
        header = settings.from_runs.read_text().partition("\n")[0] if settings.from_runs.is_file() else ""
        if not set(RUN_COLUMNS) - {"load"} <= set(header.strip().split(",")):
            parser.error(f"--from-runs: {settings.from_runs} is not a runs CSV with columns {', '.join(RUN_COLUMNS)}")
        runs = read_runs(settings.from_runs)
    else:
        corpus, tokenizer = synthetic_data(settings.work_dir)
        settings.nanotron_data = data_overrides(corpus.parent, tokenizer, tokenizer.parent / "tokens")
        runs = measure(layouts, settings)
        write_csv(runs, settings.out / "vs_torchtitan_runs.csv", RUN_COLUMNS)
    rows = summarize(runs, settings.target)
    loads = [r["load"] for r in runs if r.get("load") is not None]
    lines = ratio_lines(rows, settings.target)
    if loads:
        lines.append(f"load average (1 min) as each run started: {min(loads):.1f}-{max(loads):.1f}")
    markdown = write_table(rows, COLUMNS, settings.out / "vs_torchtitan")
    (settings.out / "vs_torchtitan.md").write_text(markdown + "\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")
    print(markdown + "\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
