"""The first GPU run: do the numbers make sense (finite, falling losses that agree across compile and
layouts) and how fast is it (tokens/s, TFLOP/s, MFU against the detected peak)?

    bash benchmarks/gpu_check.sh          # refuses to start without a CUDA device; the rows that fit 9 minutes
    python -m benchmarks.gpu_check [--budget-minutes 9] [--part 1|2|3|4 | --only-rows "a,b"] [--steps 20] [--out DIR]

A time budget (`--budget-minutes`, default 9 on CUDA, none with --quick unless given): the rows run in the priority
order below, each with an estimated cost (benchmarks/gpu_budget.py: start-up + compile + steps x step time, the
start-up and step time then measured by the eager row, the compile time by the first compile row); a row whose
estimate no longer fits what is left is not started, its verdict `skipped (budget: needs ~Xs, Ys left)`, and the
command prints the `--only-rows` command that runs the skipped ones (their reference rows come with them). The
budget counts from the command's start (the corpus's preparation included); a row that did start is stopped 30 s
past its end. The command exits 0 when every row that ran passed.
The summary, gpu_check.csv/.md/.json in --out, is replaced whole after every row; its first line (the JSON's
"status") says how far the run got. SIGTERM or SIGINT stops the row in flight (its training run too), writes the
summary (with the command that runs the rows left) and exits 128 + the signal number.

Priority order, each row's estimate on one H100 (a guess until the first GPU run measures it), by --part:
  part 1: bf16 eager ~40s, bf16 compile ~86s, host syncs ~30s, cp attention ~60s, moe grouped GEMM ~20s,
    float8 tensorwise compile ~104s, float8 rowwise compile ~105s, bf16 compile selective ~88s
  part 2: bf16 compile selective every_other ~87s, moe bf16 ~42s, muon bf16 ~42s, qwen3 bf16 ~41s, mla bf16 ~42s,
    checkpoint sync ~70s, checkpoint async ~65s, checkpoint async_pinned ~65s, doctor ~30s
  part 3 (two GPUs; one line "two-GPU part: skipped" with one): dp2 fsdp2 ~68s, dp2 resumed ~63s, cp2 ring ~48s,
    moe ep2 ~48s, moe ep2 overlap ~45s, dp2 float8 all-gather ~97s, tp2 sp float8 gather ~97s,
    tp2 compile async ~97s, qwen3 tp2 sp ~48s, mla tp2 sp ~48s, nope z-loss tp2 sp ~48s, hang watch ~90s
  part 4 (one GPU, the rows parts 1 and 2 have no room for): mtp bf16 ~44s, qwen3 moe bf16 ~42s,
    nope z-loss bf16 ~40s, rms norm ~10s
Part 1 is ~533 s, part 2 ~483 s + the eager row it is checked against (~40 s): each under 9 minutes as estimated.
Part 3 is ~800 s + its one-GPU references (~310 s): more than one slot; the budget names what is left for a rerun.
Part 4 is ~136 s (no reference row). The numerics that gate everything come first (eager, compile, the host syncs,
the kernels' numerics), then speed rows (float8, selective recompute), then the rest. --quick keeps the order but
drops the compile, float8, Qwen3, MLA, MTP, checkpoint-mode and host-sync rows.

Every training row is a fresh `python -m nanotron.train` of the ~1.1B model (TinyLlama's shape, seq 2048, bf16) on a
synthetic corpus, with a warm-up and a sane LR (3e-4, cosine to 3e-5), and the same global batch so that losses
compare step by step. One device: compile off and on, compile with selective recompute (every matmul output kept,
and every other one), and a checkpoint saved mid-run in each `checkpoint.async_mode` (sync, async, async_pinned: the
step's stall, `save_stall_sec`). With two or more: dp2 (NCCL, FSDP2 ZeRO-3, async_pinned checkpoints every `steps/2`
steps), a resume from the middle checkpoint, and tp2 with compile and async TP, and cp2 (ring attention over NCCL).
The kernel rows and the host-sync row run in a child process each (stopped at their time limit, as training rows
are): context parallelism's attention (`benchmarks/cp_check.py`: the matmul path in float64, then the fused CUDA
block kernels, flash and memory-efficient, against float64 at cp 2/4; then speed and peak memory against SDPA at
8k, 32k and 128k tokens) and the experts' grouped GEMM (`benchmarks/moe.py`'s kernel
check: padded and unpadded groups against the loop at 8 and 64 experts, then speed); with two or more, one MoE layer
at ep2 (`benchmarks/moe_overlap.py`: DeepSeek-V3's width, top 8, a shared expert) with `parallelism.ep_overlap` on
against off, its output and gradients within 2e-2 (bf16), then its time each way.
Each row is checked, and the command exits 1 if any check fails:
- every loss finite, and the last loss below the first by at least 1 nat (the model learns);
- compile, compile selective (both policies), dp2, tp2, cp2: step-1 loss within 1e-3 and the last 5 within 2e-2
  (relative) of the eager 1-device row (bf16 noise; a lost gradient is off by far more);
- float8 tensorwise and rowwise (compile, one device): step-1 loss within 1e-2 and the last 5 within 3e-2 of the
  eager bf16 row (float8's own error; a first guess to calibrate); dp2 float8 all-gather (FSDP2, ZeRO-3, tensorwise)
  and tp2 sp float8 gather (the norm outputs all-gathered in float8) within the bf16 tolerances of the 1-device
  float8 row;
- muon (optimizer.name = "muon", AdamW's lr): learns on one device; its step time against bf16 eager's is printed,
  then, where the muon row ran (`optimizer_step_line`, in this process, outside the budget's estimates), the
  optimizer step alone, Muon's with its Newton-Schulz in fp32 and in bf16 (`optimizer.muon_ns_dtype`; the row
  itself runs bf16, auto's choice on CUDA; --quick times fp32 only) against AdamW's fused one, each as a share of
  forward + backward of one micro-batch;
- qwen3 (QK-norm, head_dim 128): learns on one device; qwen3 tp2 sp within the bf16 tolerances of it;
- checkpoint sync/async/async_pinned: within the bf16 tolerances of eager (saving changes no math);
- mla (DeepSeek-V3's multi-head latent attention at the 1B width): learns on one device; mla tp2 sp within the bf16
  tolerances of it;
- mtp (multi-token prediction, `model.mtp_depth=1`, `training.mtp_loss_weight=0.3`, on the MLA row's model with the
  MoE): learns on one device, and its mtp_loss is logged at every step and finite;
- nope z-loss (SmolLM3's NoPE layers, `training.z_loss=1e-4`): learns on one device, its z_loss logged at every step
  and finite; nope z-loss tp2 sp within the bf16 tolerances of it;
- resume: the resumed steps within 1e-3 of the same steps of the uninterrupted dp2 row;
- tp2 async: no "unavailable" warning, i.e. async TP really ran;
- host syncs: one device, in a child process: steps 2-4 of 5 (not logged) under torch.cuda.set_sync_debug_mode("error")
  except inside the step agreement, the step's one intended host sync (issue 47; on CPU tests/test_train.py counts).
`--quick` runs a nano model on CPU (gloo for the 2-rank rows, no compile): the script's own smoke test.
`--only rows` runs the training rows and the kernel checks, `--only watch` the doctor and hang rows (rerun one
half after fixing it; the test suite runs the two halves separately, the watch half alone on the machine).
Speed is the median over the steps after --warmup.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.common import (
    FORK_LAUNCHER,
    REPO,
    ForkedRun,
    bench_env,
    bench_parser,
    ensure_data,
    launch_nanotron,
    markdown_table,
    median_after_warmup,
    model_overrides,
    run_code,
)
from benchmarks.gpu_budget import (
    CPU_NANO,
    H100_1B,
    H100_1B_BATCH,
    Cost,
    estimate,
    plan,
    refine,
    rerun_command,
    skip_reason,
    with_references,
    write_summary,
)

COLUMNS = (
    "check",
    "part",
    "estimate_sec",
    "seconds",
    "device",
    "world",
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "tflops",
    "mfu",
    "peak_tflops",
    "memory_gib",
    "save_stall_sec",
    "first_loss",
    "last_loss",
    "verdict",
)


MOE = [  # each expert a quarter of the dense MLP (1b: 1408 = 5632 / 4; nano: 32), and a shared one (DeepSeek's)
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.num_shared_experts=1",
    "--model.moe.router=sigmoid",
    "--model.moe.bias_update_rate=0.001",
]

QWEN3 = ["--model.qk_norm=true", "--model.head_dim=128"]

QWEN3_MOE = [  # Qwen3-MoE's routing: softmax over the experts, top k renormalised, no shared expert, no bias
    *QWEN3,
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.router=softmax_topk",
    "--model.moe.renormalize=true",
    "--model.moe.moe_intermediate_size=1408",
]

MLA = [  # every head its own keys and values (MLA expands them per head): num_kv_heads = the 1B model's 32 heads
    "--model.num_kv_heads=32",
    "--model.q_lora_rank=512",
    "--model.kv_lora_rank=256",
    "--model.qk_nope_head_dim=64",
    "--model.qk_rope_head_dim=32",
    "--model.v_head_dim=64",
]

MTP = ["--model.mtp_depth=1", "--training.mtp_loss_weight=0.3"]
# SmolLM3's NoPE layers (every 4th of the 1B model's 22) with the z-loss at its usual weight.
NOPE_Z_LOSS = ["--model.nope_layers=3,7,11,15,19", "--training.z_loss=1e-4"]


@dataclass
class Check:
    name: str
    nproc: int
    overrides: list[str]
    reference: str | None = None  # the row whose losses this one must match
    resume_of: str | None = None  # resumes this row's middle checkpoint
    async_tp: bool = False
    save_step: int | None = None  # a checkpoint is saved after this step: the next step's excess time is its stall
    # (step-1 loss, mean of the last 5) relative tolerances against `reference`
    tolerance: tuple[float, float] = (1e-3, 2e-2)
    cost: Cost = Cost()
    part: int = 1  # --part: 1, 2 and 4 the one-GPU rows, 3 the two-GPU ones
    action: Callable[[], bool] | None = None  # a doctor/hang/host-sync row: its own commands, True when it passed
    # A kernel row: (module, function, arguments), the function run in a child process (so that the row can be stopped
    # at its time limit or by SIGTERM, as a training row is), True when it passed.
    kernel: tuple[str, str, tuple] | None = None
    logged: tuple[str, ...] = ()  # metrics the row must log at every step, finite (beside the loss)
    watch: bool = False  # `--only watch`'s rows
    problems: list[str] = field(default_factory=list)

    @property
    def needs(self) -> list[str]:
        return [name for name in (self.reference, self.resume_of) if name is not None]


def checks(
    settings: argparse.Namespace, device: str = "cuda", common: list[str] = (), n_devices: int = 1
) -> list[Check]:
    """Every row, in priority order (the docstring's): the numerics everything else leans on, then speed, then
    the rest; the two-GPU rows last (dropped in one line with one GPU)."""
    quick = settings.quick
    cpu = (lambda gpu_sec, cpu_sec: cpu_sec) if quick else (lambda gpu_sec, cpu_sec: gpu_sec)
    compile_ = Cost(step_factor=0.75, compile=True)
    # A mixture of experts of the same shape (8 experts, top 2, each a quarter of the MLP): the grouped GEMM path.
    moe = [*MOE, f"--model.moe.moe_intermediate_size={32 if quick else 1408}"]
    seq_lens = (256,) if quick else (8192, 32768, 131072)
    rows = [
        Check("bf16 eager", 1, []),
        Check("bf16 compile", 1, ["--training.compile=true"], "bf16 eager", cost=compile_),
        Check(
            "host syncs",
            1,
            [],
            cost=Cost(False, fixed_sec=30),
            kernel=("benchmarks.gpu_check", "host_sync_check", (list(common), str(settings.work_dir))),
        ),
        Check(
            "cp attention",  # the ring's CUDA block kernels against float64, then speed and memory (one device)
            1,
            [],
            cost=Cost(False, fixed_sec=cpu(60, 15)),
            kernel=("benchmarks.cp_check", "check", (device, seq_lens)),
        ),
        Check(
            "moe grouped GEMM",  # padded groups against the per-expert loop at 8 and 64 experts, then speed
            1,
            [],
            cost=Cost(False, fixed_sec=cpu(20, 5)),
            kernel=("benchmarks.moe", "kernel_check", (device,)),
        ),
        *float8_checks(settings),
        # Selective activation checkpointing under compile (torchtitan's default pairing): its speed and memory
        # against the compile row, its losses against eager; then torchtitan's op-level policy (every other
        # matmul kept), its default under compile.
        Check(
            "bf16 compile selective",
            1,
            ["--training.compile=true", "--parallelism.recompute=selective"],
            "bf16 eager",
            cost=replace(compile_, step_factor=0.85),
        ),
        Check(
            "bf16 compile selective every_other",
            1,
            [
                "--training.compile=true",
                "--parallelism.recompute=selective",
                "--parallelism.selective_matmuls=every_other",
            ],
            "bf16 eager",
            cost=replace(compile_, step_factor=0.8),
            part=2,
        ),
        Check("moe bf16", 1, moe, cost=Cost(step_factor=1.1), part=2),
        # Muon (AdamW's lr carries over: Moonlight's scaling) must learn too; its step time against bf16 eager's.
        Check("muon bf16", 1, ["--optimizer.name=muon"], cost=Cost(step_factor=1.15), part=2),
        # Qwen3's attention (QK-norm, head_dim 128 apart from hidden / heads): finite falling losses on one
        # device, and sequence-parallel TP held to it on two (the norm's replicated weight, its gradient summed).
        Check("qwen3 bf16", 1, QWEN3, cost=Cost(step_factor=1.05), part=2),
        # DeepSeek-V3's multi-head latent attention at the 1B width (32 heads of 64 + 32 for queries/keys and 64
        # for values from latents of 512 and 256): learns on one device, and sequence-parallel TP held to it on
        # two (heads split, the latents' down-projections replicated, the shared RoPE key's gradient summed).
        Check("mla bf16", 1, MLA, cost=Cost(step_factor=1.1), part=2),
        *checkpoint_checks(settings),
        Check(
            "doctor",
            1,
            [],
            cost=Cost(False, fixed_sec=cpu(30, 30)),
            action=lambda: doctor_check(common, n_devices, settings),
            part=2,
            watch=True,
        ),
        *two_gpu_checks(settings, device, common, moe),
        # DeepSeek-V3's multi-token prediction (depth 1, lambda 0.3) on the MLA row's model with the MoE (so the MTP
        # module's block is a MoE layer, as in DeepSeek-V3): learns, its mtp_loss logged every step and finite.
        # Part 4: parts 1 and 2 are full (each planned to fit 9 minutes).
        Check(
            "mtp bf16",
            1,
            [*MLA, *moe, *MTP],
            cost=Cost(step_factor=1.25),
            part=4,
            logged=("mtp_loss",),
        ),
        # Qwen3-MoE (Qwen3's attention with its softmax top-k routing, no shared expert) at the 1B width: learns on
        # one device through the grouped GEMM path. Part 4 beside mtp: parts 1 and 2 are full.
        Check("qwen3 moe bf16", 1, QWEN3_MOE, cost=Cost(step_factor=1.1), part=4),
        # NoPE layers and the z-loss: learns on one device with z_loss logged every step and finite; sequence-
        # parallel TP held to it on two (the log-normaliser of vocab-sharded logits reduced over tp).
        Check("nope z-loss bf16", 1, NOPE_Z_LOSS, cost=Cost(step_factor=1.02), part=4, logged=("z_loss",)),
        Check(
            "rms norm",  # the eager RMSNorm against the plain formula: bit for bit, then time and bytes kept
            1,
            [],
            cost=Cost(False, fixed_sec=cpu(10, 5)),
            part=4,
            kernel=("benchmarks.gpu_check", "norm_check", (device,)),
        ),
    ]
    cuda_only = {"host syncs", "qwen3 bf16", "mla bf16", "mtp bf16", "qwen3 moe bf16", "nope z-loss bf16"} | {
        c.name for c in rows if c.cost.compile
    }
    return [c for c in rows if not (quick and (c.name in cuda_only or c.name.startswith("checkpoint ")))]


def two_gpu_checks(settings: argparse.Namespace, device: str, common: list[str], moe: list[str]) -> list[Check]:
    """Part 3: dp2 (FSDP2 over NCCL, async checkpoints, a resume), cp2, ep2, then (not in --quick) float8's
    all-gather, async TP and sequence-parallel TP of Qwen3 and MLA; the ep2 overlap layer and the hang watcher."""
    quick, half = settings.quick, settings.steps // 2
    pinned = "async" if quick else "async_pinned"  # CPU has no pinned memory (refused there)
    saving = [f"--checkpoint.interval={half}", f"--checkpoint.async_mode={pinned}", "--checkpoint.keep_last=0"]
    dp2 = ["--parallelism.dp=2", "--parallelism.zero_stage=3"]
    two = Cost(step_factor=0.55, fixed_sec=15)  # half the batch per GPU; torchrun's start-up
    rows = [
        Check("dp2 fsdp2", 2, [*dp2, *saving], "bf16 eager", cost=replace(two, fixed_sec=35), part=3),
        Check("dp2 resumed", 2, dp2, resume_of="dp2 fsdp2", cost=replace(two, fixed_sec=30), part=3),
        Check("cp2 ring", 2, ["--parallelism.cp=2"], "bf16 eager", cost=two, part=3),  # the ring over NCCL p2p
        Check(
            "moe ep2", 2, [*moe, "--parallelism.dp=2", "--parallelism.ep=2"], "moe bf16", cost=two, part=3
        ),  # NCCL all-to-all
        Check(
            "moe ep2 overlap",  # one MoE layer, the shared experts under the token all-to-all, on against off
            2,
            [],
            cost=Cost(False, fixed_sec=45 if not quick else 20),
            kernel=("benchmarks.moe_overlap", "overlap_check", (device, 2)),
            part=3,
        ),
    ]
    if not quick:
        # FSDP2's float8 all-gather (tensorwise) with its per-step scale precompute, against the 1-device float8 row.
        float8_dp2 = [*dp2, *FLOAT8_COMPILE, "--training.float8=tensorwise"]
        float8_tp = [*FLOAT8_COMPILE, "--training.float8=tensorwise", "--parallelism.tp=2"]
        async_tp = ["--parallelism.tp=2", "--training.compile=true", "--parallelism.tp_linear_async_communication=true"]
        compiled = replace(two, compile=True, step_factor=0.45)
        rows += [
            Check("dp2 float8 all-gather", 2, float8_dp2, "float8 tensorwise compile", cost=compiled, part=3),
            # Sequence-parallel TP in float8 (tensorwise): the norm outputs cast before their all-gather (torchao's
            # PrepareFloat8ModuleInput), each amax reduced over tp, so the 1-device row's scales and float8 values;
            # only the row-parallel sums' order differs, as in bf16 TP: bf16's tolerances. gloo cannot move float8,
            # so no CPU test holds these numbers (tests/test_float8.py checks the wiring on the fake process group).
            Check("tp2 sp float8 gather", 2, float8_tp, "float8 tensorwise compile", cost=compiled, part=3),
            Check("tp2 compile async", 2, async_tp, "bf16 eager", async_tp=True, cost=compiled, part=3),
            Check("qwen3 tp2 sp", 2, [*QWEN3, "--parallelism.tp=2"], "qwen3 bf16", cost=two, part=3),
            Check("mla tp2 sp", 2, [*MLA, "--parallelism.tp=2"], "mla bf16", cost=two, part=3),
            Check("nope z-loss tp2 sp", 2, [*NOPE_Z_LOSS, "--parallelism.tp=2"], "nope z-loss bf16", cost=two, part=3),
        ]
    hang = Check("hang watch", 2, [], cost=Cost(False, fixed_sec=90), part=3, watch=True)
    hang.action = lambda: hang_check(common, settings)
    return [*rows, hang]


def checkpoint_checks(settings: argparse.Namespace) -> list[Check]:
    """The training step's stall when a checkpoint is saved mid-run, per checkpoint.async_mode (one device): the
    step after the save against the median step. sync: the whole write; async: the copy to pageable host memory;
    async_pinned: the copy to pinned memory, overlapped. Losses held to bf16 eager (saving changes no math). Not
    in --quick (CPU has no pinned memory; tests/test_checkpoint.py covers the modes there)."""
    half = settings.steps // 2
    return [
        Check(
            f"checkpoint {mode}",
            1,
            [f"--checkpoint.interval={half}", f"--checkpoint.async_mode={mode}", "--checkpoint.keep_last=0"],
            "bf16 eager",
            save_step=half,
            cost=Cost(fixed_sec=30 if mode == "sync" else 25),  # a 1B model's ~13 GB written (or waited for)
            part=2,
        )
        for mode in ("sync", "async", "async_pinned")
    ]


FLOAT8_COMPILE = ["--training.compile=true"]
# Float8 against bf16: e4m3 operands put ~5e-2 relative error on each matmul's output (checked on CPU emulation), far
# above bf16's. A first guess until the first GPU run calibrates it: 1e-2 at step 1, 3e-2 over the last 5 steps.
FLOAT8_TOLERANCE = (1e-2, 3e-2)


def float8_checks(settings: argparse.Namespace) -> list[Check]:
    """Tensorwise and rowwise float8 (torchao) on one device with compile: tokens/s and MFU against `bf16 compile`,
    losses against bf16 eager. Not in --quick: emulation on CPU is eager-only and no faster (the test suite holds
    float8's CPU numerics to one process at every layout instead)."""
    return [
        Check(
            f"float8 {recipe} compile",
            1,
            [*FLOAT8_COMPILE, f"--training.float8={recipe}"],
            "bf16 eager",
            tolerance=FLOAT8_TOLERANCE,
            cost=Cost(step_factor=factor, compile=True, fixed_sec=20),  # float8's own compile on top
        )
        for recipe, factor in (("tensorwise", 0.6), ("rowwise", 0.65))
    ]


def run_check(
    check: Check, settings: argparse.Namespace, common: list[str], done: dict[str, dict], timeout: float
) -> dict:
    """One training row, stopped after `timeout` seconds (or when this process is told to stop: `Stopped`)."""
    name = "gpu_check-" + check.name.replace(" ", "_")
    args = [*common, *check.overrides]
    if check.resume_of is not None:
        saved = settings.work_dir / "runs" / done[check.resume_of]["run"] / "checkpoints"
        args.append(f"--checkpoint.resume_from={saved / f'step-{settings.steps // 2}'}")
    start = time.perf_counter()
    proc, run_dir = launch_nanotron(name, args, check.nproc, settings.work_dir)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        stdout, stderr = "", ""
        check.problems.append(f"stopped after {timeout:.0f}s (its time limit, or the budget's end)")
    except BaseException:
        _end(proc)  # Stopped (SIGTERM/SIGINT): no training run outlives the check
        raise
    records = _records(run_dir)
    row = {"check": check.name, "run": name, "world": check.nproc, "seconds": time.perf_counter() - start}
    if check.problems:
        return row | {"losses": {}}
    if proc.returncode != 0 or not records:
        check.problems.append(f"run failed (exit {proc.returncode}): {stderr.strip().splitlines()[-1:]}")
        print(stdout[-3000:], stderr[-5000:], sep="\n", file=sys.stderr)
        return row | {"losses": {}}
    losses = {r["step"]: r["loss"] for r in records}
    row["logged"] = {key: {r["step"]: r.get(key) for r in records} for key in check.logged}
    steady = records[settings.warmup :] or records
    for key in ("tokens_per_sec", "tokens_per_sec_per_device", "tflops", "mfu"):
        row[key] = statistics.median(r[key] for r in steady)
    row["step_time_sec"] = median_after_warmup([r["step_time_sec"] for r in records], settings.warmup)
    row["memory_gib"] = max(r["memory_gib"] for r in records)
    if check.save_step is not None:
        times = {r["step"]: r["step_time_sec"] for r in records}
        others = [t for step, t in times.items() if step > settings.warmup and step != check.save_step + 1]
        row["save_stall_sec"] = times[check.save_step + 1] - statistics.median(others)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~13 GB each at 1B: the disk is 64 GB
    row["first_loss"], row["last_loss"] = losses[min(losses)], losses[max(losses)]
    row["losses"] = losses
    if check.async_tp and "tp_linear_async_communication" in stdout + stderr:
        check.problems.append("async TP did not run (see the trainer's warning)")
    return row


def verify(check: Check, row: dict, done: dict[str, dict]) -> None:
    """Appends to check.problems what is wrong with this row's losses."""
    losses = row["losses"]
    if not losses:
        return
    if not all(math.isfinite(v) for v in losses.values()):
        check.problems.append("non-finite loss")
    if check.resume_of is None and not row["last_loss"] < row["first_loss"] - 1.0:
        check.problems.append(f"loss did not fall ({row['first_loss']:.3f} -> {row['last_loss']:.3f})")
    for key in check.logged:
        values = row.get("logged", {}).get(key, {})
        missing = [step for step in losses if values.get(step) is None]
        if missing:
            check.problems.append(f"{key} not logged at steps {missing}")
        elif not all(math.isfinite(values[step]) for step in losses):
            check.problems.append(f"non-finite {key}")
    if check.reference is not None:
        ref = done[check.reference]["losses"]
        if not ref:
            check.problems.append(f"no losses from {check.reference} to compare with")
            return
        first, tail = min(ref), sorted(ref)[-5:]
        first_rtol, tail_rtol = check.tolerance
        if _rel(losses.get(first), ref[first]) > first_rtol:
            check.problems.append(f"step {first} loss {losses.get(first)} vs {ref[first]} ({check.reference})")
        gap = _rel(statistics.mean(losses[s] for s in tail), statistics.mean(ref[s] for s in tail))
        if gap > tail_rtol:
            check.problems.append(f"last 5 losses {gap:.2e} from {check.reference}")
    if check.resume_of is not None:
        ref = done[check.resume_of]["losses"]
        gap = max(_rel(v, ref.get(step)) for step, v in losses.items())
        if gap > 1e-3:
            check.problems.append(f"resumed losses {gap:.2e} from the uninterrupted run")


def _end(proc: subprocess.Popen) -> None:
    """Stops a training run: SIGTERM (torchrun passes it to its ranks), then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _watch_base(common: list[str], n_devices: int, settings: argparse.Namespace) -> list[str]:
    base = ["--nproc_per_node", str(n_devices), "--config", "configs/tiny.toml"]  # after `python -m nanotron CMD`
    base += [arg for arg in common if arg.startswith(("--training.device", "--data."))]
    return [*base, f"--job.out_dir={settings.work_dir / 'runs'}", f"--parallelism.dp={n_devices}"]


def doctor_check(common: list[str], n_devices: int, settings: argparse.Namespace) -> bool:
    """`nanotron doctor` on the visible devices: a healthy run passes (exit 0, its table printed) and an injected
    wrong matmul on rank 0 is caught (exit 2: named, but with one node a requeue without it would have no node
    left, so a person looks): the checksum and fp64-reference checks on the device's own math."""
    runs = [("doctor", "", 0, "doctor: "), ("doctor", "rank:0,step:0,kind:bad_matmul", 2, "doctor: rank 0 ")]
    return _watch_runs(_watch_base(common, n_devices, settings), runs, settings)


def hang_check(common: list[str], settings: argparse.Namespace) -> bool:
    """Two devices: a hang on NCCL (rank 1 sleeps in data at step 3) that the watcher must name; on CUDA also
    NCCL's own dump on timeout with the watcher off."""
    base = _watch_base(common, 2, settings)
    ok = _watch_runs(base, [("train", "rank:1,step:3,kind:sleep", 75, "hang: rank 1 ")], settings)
    if "--training.device=cuda" in common:
        ok &= nccl_dump_on_timeout(base, settings)
    return ok


def _watch_runs(base: list[str], runs: list[tuple[str, str, int, str]], settings: argparse.Namespace) -> bool:
    ok = True
    for command, fault, expected, line in runs:
        argv = [sys.executable, "-m", "nanotron", command, *base, f"--job.name=watch-{command}"]
        argv += ["--training.steps=10", "--watch.floor_seconds=20"] if command == "train" else []
        env = bench_env() | ({"NANOTRON_FAULT": fault} if fault else {})
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=settings.timeout)
        good = proc.returncode == expected and line in proc.stdout + proc.stderr
        verdict = "ok" if good else f"exit {proc.returncode} (expected {expected}, and a line with {line!r})"
        print(f"{command} {fault or 'healthy':32s} {verdict}", flush=True)
        print(f"{proc.stdout.strip()[-3000:]}\n{proc.stderr.strip()[-2000:]}", flush=True)
        ok &= good
    return ok


def nccl_dump_on_timeout(base: list[str], settings: argparse.Namespace) -> bool:
    """NCCL's own flight recorder (TORCH_NCCL_DUMP_ON_TIMEOUT, set by default): with the watcher off, a hang must
    end in NCCL's watchdog timeout and leave <run dir>/nccl_trace_rank_<r> files."""
    name = "watch-nccl-timeout"
    argv = [sys.executable, "-m", "nanotron", "train", *base, f"--job.name={name}", "--training.steps=10"]
    argv += ["--watch.enabled=false", "--distributed.timeout_minutes=0.2", "--distributed.startup_timeout_minutes=0.5"]
    env = bench_env() | {"NANOTRON_FAULT": "rank:1,step:3,kind:sleep"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=settings.timeout)
    dumps = sorted((settings.work_dir / "runs" / name).glob("nccl_trace_rank_*"))
    good = proc.returncode != 0 and bool(dumps)
    print(f"nccl dump on timeout {'ok' if good else f'exit {proc.returncode}, dumps {dumps}'}", flush=True)
    return good


def _rel(a: float | None, b: float | None) -> float:
    return math.inf if a is None or b is None else abs(a - b) / abs(b)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if "step_time_sec" in r]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("gpu_check", __doc__)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the speed medians")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per microbatch (lower it on <80 GB)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step, every row")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as hung")
    parser.add_argument("--quick", action="store_true", help="nano model on CPU: a smoke test of this script")
    parser.add_argument("--only", choices=("rows", "watch"), help="the training rows and kernels, or the watch checks")
    parser.add_argument(
        "--budget-minutes",
        type=float,
        help="rows whose estimate no longer fits are skipped and named (default 9 on CUDA, none with --quick)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--part",
        type=int,
        choices=(1, 2, 3, 4),
        help="1, 2, 4: the one-GPU rows (4: what 1 and 2 had no room for); 3: two-GPU",
    )
    which.add_argument("--only-rows", help="comma-separated row names (their reference rows come with them)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check", help="folder for gpu_check.csv/.md")
    parser.add_argument("--work-dir", type=Path, default=REPO / ".cache" / "gpu_check", help="corpus and run dirs")
    settings = parser.parse_args(argv)
    settings.started = time.monotonic()  # the budget counts the data preparation and start-up too
    import torch

    from nanotron.gpu import gpu_peak_tflops

    if settings.quick:
        settings.steps, settings.warmup, settings.micro_batch, settings.global_batch = 12, 2, 2, 8
        device, n_devices, name, size, peak = "cpu", 2, "cpu", "nano", None
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (use --quick for the CPU smoke test)", file=sys.stderr)
        return 2
    else:
        device, n_devices, name, size = "cuda", torch.cuda.device_count(), torch.cuda.get_device_name(0), "1b"
        peak = gpu_peak_tflops(name, "bf16")
        settings.budget_minutes = 9.0 if settings.budget_minutes is None else settings.budget_minutes
    common = [
        *ensure_data(settings.work_dir, n_docs=4000 if not settings.quick else 600),
        *model_overrides(size),
        f"--training.device={device}",
        "--training.dtype=bfloat16",
        f"--training.steps={settings.steps}",
        f"--training.micro_batch_size={settings.micro_batch}",
        f"--training.global_batch_size={settings.global_batch}",
        "--training.grad_accum_steps=0",
        "--training.eval_interval=0",
        f"--optimizer.lr={3e-3 if settings.quick else 3e-4}",
        f"--optimizer.min_lr={3e-4 if settings.quick else 3e-5}",
        f"--optimizer.warmup_steps={max(settings.steps // 4, 1)}",
        "--optimizer.decay_style=cosine",
        "--logging.log_interval=1",
        "--logging.tensorboard=false",
        "--checkpoint.save_final=false",
        "--checkpoint.resume_from=none",
        *(["--logging.peak_tflops=1"] if settings.quick else []),
    ]
    if settings.budget_minutes is not None and not settings.budget_minutes > 0:
        print(f"gpu_check: --budget-minutes {settings.budget_minutes}: expected minutes > 0 (leave it out: 9 on CUDA)")
        return 2
    rows = checks(settings, device, common, n_devices)
    try:
        chosen = choose(rows, settings)
    except ValueError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    print(f"device: {name} x {n_devices}; bf16 dense peak {peak or 'unknown'} TFLOP/s per device", flush=True)
    try:
        return run_rows(chosen, settings, common, name, peak, n_devices)
    finally:
        for checkpoints in (settings.work_dir / "runs").glob("*/checkpoints"):
            shutil.rmtree(checkpoints)  # 1B checkpoints with optimizer state: ~13 GB each


def choose(rows: list[Check], settings: argparse.Namespace) -> list[Check]:
    """The rows --only, --part or --only-rows selects, with the rows they are checked against, in priority order."""
    by_name = {c.name: c for c in rows}
    if settings.only_rows is not None:
        names = [n.strip() for n in settings.only_rows.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown or not names:
            raise ValueError(
                f"--only-rows: no row named {unknown or names!r}; expected a comma-separated list of: "
                f"{', '.join(by_name)}"
            )
    else:
        names = [c.name for c in rows if settings.part in (None, c.part)]
        names = [n for n in names if settings.only is None or (settings.only == "watch") == by_name[n].watch]
    needs = {c.name: c.needs for c in rows}
    return [by_name[n] for n in with_references(names, needs, [c.name for c in rows])]


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived: the row in flight ends, the summary is written, the command exits non-zero."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signum)


def run_rows(
    rows: list[Check], settings: argparse.Namespace, common: list[str], name: str, peak: float | None, n_devices: int
) -> int:
    """Each row in turn while its estimate fits the budget left; the summary rewritten after each (gpu_check.csv,
    .md, .json: a kill at the command's limit keeps the rows that ran). 0 when every row that ran passed."""
    budget = None if settings.budget_minutes is None else 60 * settings.budget_minutes
    timing = CPU_NANO if settings.quick else H100_1B
    timing = replace(
        timing, step_sec=timing.step_sec * settings.global_batch / (8 if settings.quick else H100_1B_BATCH)
    )
    base = "python -m benchmarks.gpu_check --quick" if settings.quick else "bash benchmarks/gpu_check.sh"
    notes: list[str] = []
    if n_devices < 2 and any(c.nproc > 1 for c in rows):
        names = [c.name for c in rows if c.nproc > 1]
        notes.append(f"two-GPU part: skipped ({n_devices} GPU visible): {', '.join(names)}")
        print(notes[-1], flush=True)
        rows = [c for c in rows if c.nproc == 1]
    planned = plan([(c.name, estimate(c.cost, timing, settings.steps), c.needs) for c in rows], budget)
    print(
        f"plan ({'no budget' if budget is None else f'budget {budget:.0f}s'}): "
        + ", ".join(f"{c.name} ~{estimate(c.cost, timing, settings.steps):.0f}s" for c in rows)
        + f"; would skip {[n for n, reason in planned if reason] or 'none'}",
        flush=True,
    )
    done: dict[str, dict] = {}
    table: list[dict] = []
    skipped: list[str] = []
    start = settings.started
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def summary(state: str, rerun_rows: list[str] = skipped) -> None:
        ran = [r for r in table if r["check"] in done]  # not the skipped rows, nor one a signal stopped
        failed = sum(r["verdict"] != "ok" for r in ran)
        header = (
            f"gpu_check {state}: {len(ran)} of {len(rows)} rows ran ({failed} failed), {len(skipped)} skipped, "
            f"{len(rows) - len(table)} not reached; {time.monotonic() - start:.0f}s"
            + ("" if budget is None else f" of a {budget:.0f}s budget")
        )
        rerun = f"to run the rest: {rerun_command(rerun_rows, base)}" if rerun_rows else ""
        extra = {"device": name, "world": n_devices, "budget_sec": budget, "notes": [*notes, rerun]}
        write_summary(settings.out / "gpu_check", header, table, COLUMNS, extra)

    check = None
    try:
        for check in rows:
            left = None if budget is None else budget - (time.monotonic() - start)
            cost = estimate(check.cost, timing, settings.steps)
            reason = skip_reason(cost, left, [n for n in check.needs if n not in done])
            if reason is not None:
                skipped.append(check.name)
                table.append({"check": check.name, "part": check.part, "estimate_sec": round(cost), "verdict": reason})
                print(f"{check.name:20s} {reason}", flush=True)
                summary(f"running (after {check.name})")
                continue
            row = run_one(check, settings, common, done, None if left is None else left + ROW_GRACE_SEC)
            row |= {"device": name, "peak_tflops": peak or 0.0, "part": check.part, "estimate_sec": round(cost)}
            row["verdict"] = "; ".join(check.problems) or "ok"
            done[check.name] = row
            table.append(row)
            if check.name in CALIBRATING and "step_time_sec" in row:
                timing = refine(timing, check.cost, row["seconds"], row["step_time_sec"], settings.steps)
            summary(f"running (after {check.name})")
        summary("complete")
    except Stopped as stop:
        if check is not None and check.name not in done and all(r["check"] != check.name for r in table):
            table.append({"check": check.name, "part": check.part, "verdict": f"stopped by {stop}"})
        rest = [c.name for c in rows if c.name not in done]  # the stopped row, the skipped ones, those not reached
        summary(f"stopped by {stop} during {check.name if check else 'start-up'}", rest)
        print(f"gpu_check: stopped by {stop}; the summary of what ran is in {settings.out}", flush=True)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(markdown_table(table, COLUMNS))
    print(optimizer_line(done), flush=True)
    if "muon bf16" in done:
        print(optimizer_step_line(settings, "cpu" if settings.quick else "cuda"), flush=True)
    if skipped:
        print(f"skipped rows, to run next: {rerun_command(skipped, base)}", flush=True)
    return 1 if any(r["verdict"] != "ok" for r in done.values()) else 0


CALIBRATING = ("bf16 eager", "bf16 compile")  # their measurements replace the start-up, step and compile guesses
# A row started within the budget may overrun it by this much before it is stopped: 9 minutes from the command's
# start plus this stays inside a 10-minute command limit (the lent GPU machines' tool), interpreter start included.
ROW_GRACE_SEC = 30.0


def run_one(check: Check, settings: argparse.Namespace, common: list[str], done: dict, limit: float | None) -> dict:
    """One row: a training run checked against its reference, or an in-process kernel/doctor check."""
    timeout = settings.timeout if limit is None else min(settings.timeout, limit)
    if check.action is None and check.kernel is None:
        row = run_check(check, settings, common, done, timeout)
        verify(check, row, done)
        print(
            f"{check.name:20s} {row.get('tokens_per_sec', 0):10.0f} tokens/s {row.get('tflops', 0):8.1f} TFLOP/s "
            f"MFU {100 * row.get('mfu', 0):5.1f}%  loss {row.get('first_loss', math.nan):.3f} -> "
            f"{row.get('last_loss', math.nan):.3f}  ({row['seconds']:.0f} s)  "
            + (f"save stall {row['save_stall_sec']:.2f} s  " if "save_stall_sec" in row else "")
            + ("; ".join(check.problems) or "ok"),
            flush=True,
        )
        return row
    begin = time.perf_counter()
    if check.kernel is not None:
        passed, stopped = run_kernel(check.kernel, timeout)
        if stopped:
            check.problems.append(stopped)
    else:
        try:
            passed = check.action()
        except Exception:  # a crash in one check is that row's failure; the rows after it still run
            traceback.print_exc()
            passed = False
    if not passed and not check.problems:
        check.problems.append("failed (its lines above say which)")
    seconds = time.perf_counter() - begin
    print(f"{check.name:20s} ({seconds:.0f} s)  {'; '.join(check.problems) or 'ok'}", flush=True)
    return {"check": check.name, "world": check.nproc, "seconds": seconds, "losses": {}}


def run_kernel(kernel: tuple[str, str, tuple], timeout: float) -> tuple[bool, str | None]:
    """`module.function(*arguments)` in a child process of this interpreter, its lines printed as they come:
    (whether it returned True, why it was stopped or None). Stopped after `timeout` seconds, or with this process
    (`Stopped`): a kernel stuck on the device must not hold the GPU slot past its budget."""
    module, function, arguments = kernel
    code = f"import sys, {module}\nsys.exit(0 if {module}.{function}(*{arguments!r}) else 1)"
    popen = subprocess.Popen
    if os.environ.get(FORK_LAUNCHER):  # the test suite's smoke run: forked from this process, imports done
        popen = functools.partial(ForkedRun, lambda: run_code(code))
    proc = popen([sys.executable, "-c", code], cwd=REPO)
    try:
        return proc.wait(timeout=timeout) == 0, None
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False, f"stopped after {timeout:.0f}s (its time limit, or the budget's end)"
    except BaseException:
        proc.kill()  # Stopped (SIGTERM/SIGINT): the kernel does not outlive the check
        proc.wait()
        raise


def optimizer_line(done: dict[str, dict]) -> str:
    """Muon's step time against AdamW's on one device (the same model, batch and steps): the orthogonalisation's
    cost, all of it on the one rank here."""
    muon, adamw = (done.get(name, {}).get("step_time_sec") for name in ("muon bf16", "bf16 eager"))
    if not muon or not adamw:
        return "optimizer: muon or adamw row missing, no step time comparison"
    return f"optimizer: muon step {muon:.3f}s vs adamw {adamw:.3f}s ({muon / adamw:.2f}x) on one device"


def optimizer_step_line(settings: argparse.Namespace, device: str) -> str:
    """Muon's optimizer step alone, its Newton-Schulz in fp32 and in bf16 (`optimizer.muon_ns_dtype`), against
    AdamW's on one device, the model of the rows (fp32 master weights, bf16 autocast on CUDA), medians of 5 steps
    after 2 (`benchmarks.muon_quality.step_share`): the orthogonalisation's own time, which the whole-step
    comparison above mixes with forward and backward. On CPU (--quick) fp32 only: bf16 matmuls are slow there."""
    import torch

    from benchmarks.muon_quality import step_share

    micro = settings.micro_batch
    overrides = [
        *model_overrides("nano" if settings.quick else "1b"),
        f"--training.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
        f"--training.micro_batch_size={micro}",
        f"--training.global_batch_size={micro}",
    ]
    runs = {"adamw": ("adamw", []), "muon fp32": ("muon", ["--optimizer.muon_ns_dtype=float32"])}
    if device == "cuda":
        runs["muon bf16"] = ("muon", ["--optimizer.muon_ns_dtype=bfloat16"])
    rows = {
        label: step_share([*overrides, *extra], name, repeats=5, device=device) for label, (name, extra) in runs.items()
    }
    if device == "cuda":
        torch.cuda.empty_cache()
    muons, adamw = [label for label in rows if label != "adamw"], rows["adamw"]
    times = ", ".join(f"{label} {rows[label]['optimizer_step_s']:.4f}s" for label in muons)
    shares = ", ".join(f"{label} {100 * rows[label]['share']:.1f}%" for label in [*muons, "adamw"])
    return (
        f"optimizer step alone: {times} vs adamw {adamw['optimizer_step_s']:.4f}s; share of a step of one "
        f"micro-batch of {micro}: {shares} (forward + backward {adamw['forward_backward_s']:.3f}s)"
        + ("" if device == "cuda" else "; Newton-Schulz in fp32 only on CPU (its bf16 matmuls are slow)")
    )


def norm_check(device: str) -> bool:
    """RMSNorm's eager autograd function on `device` against the plain formula (what the compiler traces), at the ~1B
    model's width and a microbatch of 8k tokens: output and both gradients bit for bit in bf16 and fp32 (the CPU
    tests check this on CPU; a device's kernels round each op alike, which this checks), then forward + backward
    time and the bytes each keeps for backward."""
    import time

    import torch

    from nanotron.models.llama import RMSNorm, rms_norm

    hidden, tokens = (2048, 8192) if device == "cuda" else (256, 512)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    passed = True
    for dtype in (torch.bfloat16, torch.float32):
        norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
        gen = torch.Generator(device=device).manual_seed(0)
        x0 = torch.randn(1, tokens, hidden, device=device, generator=gen).to(dtype)
        grad = torch.randn(1, tokens, hidden, device=device, generator=gen).to(dtype)
        variants = {"eager": norm, "plain": lambda x, norm=norm: rms_norm(x, norm.weight, norm.eps)}
        results, kept, seconds = {}, {}, {}
        for name, fn in variants.items():
            saved: list[torch.Tensor] = []

            def pack(t, saved=saved):
                saved.append(t)
                return t

            x = x0.clone().requires_grad_()
            norm.weight.grad = None
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn(x)
            out.backward(grad)
            results[name] = (out.detach(), x.grad, norm.weight.grad)
            unique = {(t.data_ptr(), t.numel(), t.dtype): t for t in saved if not isinstance(t, torch.nn.Parameter)}
            kept[name] = sum(t.numel() * t.element_size() for t in unique.values())  # a tensor saved twice: once
            times = []
            for _ in range(20):
                x = x0.clone().requires_grad_()
                sync()
                start = time.perf_counter()
                fn(x).backward(grad)
                sync()
                times.append(time.perf_counter() - start)
            seconds[name] = statistics.median(times)
        same = all(torch.equal(a, b) for a, b in zip(results["eager"], results["plain"], strict=True))
        passed &= same
        print(
            f"rms norm {str(dtype).removeprefix('torch.')} [{tokens}, {hidden}]: "
            f"bit for bit {'yes' if same else 'NO'}; "
            f"forward + backward {seconds['eager'] * 1e3:.3f} ms against {seconds['plain'] * 1e3:.3f} "
            f"({seconds['eager'] / seconds['plain']:.2f}x); kept {kept['eager'] / 2**20:.1f} MiB against "
            f"{kept['plain'] / 2**20:.1f}",
            flush=True,
        )
    return passed


def host_sync_check(common: list[str], work_dir: str) -> bool:
    """A step makes the host wait for the GPU once, in the step agreement (`ParallelContext.agree`): a 5-step run on
    one device in the row's child process, logging only steps 1 and 5, with every other sync of steps 2-4 (their
    ends included) an error."""
    import torch

    from nanotron.config import load_config, parse_overrides
    from nanotron.parallel.mesh import destroy_distributed
    from nanotron.trainer import Trainer

    run = [f"--job.out_dir={Path(work_dir) / 'runs'}", "--job.name=gpu_check-host_syncs"]
    cfg = load_config(*parse_overrides([*common, *run, "--training.steps=5", "--logging.log_interval=1000"]))
    trainer = Trainer(cfg)
    checked = {"mode": "default", "agreements": 0}
    agree, train_step = trainer.agree, trainer.train_step

    def agreement(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return agree(*args, **kwargs)
        finally:
            checked["agreements"] += checked["mode"] == "error"
            torch.cuda.set_sync_debug_mode(checked["mode"])

    def step():
        checked["mode"] = "error" if 2 <= trainer.state.step + 1 < cfg.training.steps else "default"
        torch.cuda.set_sync_debug_mode(checked["mode"])  # stays on through the step's end, until the next step
        return train_step()

    trainer.agree, trainer.train_step = agreement, step
    try:
        trainer.train()
        problem = None if checked["agreements"] == 3 else f"{checked['agreements']} step agreements in 3 steps"
    except RuntimeError as error:  # "called a synchronizing CUDA operation": where is in the traceback
        import traceback

        traceback.print_exc()
        problem = f"a host sync outside the step agreement: {str(error).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        stopped = trainer.stop.requested  # the trainer traps SIGTERM/SIGINT (Ctrl-C reaches this child too)
        trainer.close()
        destroy_distributed()
    if stopped:
        print("host syncs: stopped by a signal", flush=True)
        return False
    print(f"host syncs per step: {'1 (the step agreement)' if problem is None else problem}", flush=True)
    return problem is None


if __name__ == "__main__":
    sys.exit(main())
