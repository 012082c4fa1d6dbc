"""The first GPU run: do the numbers make sense (finite, falling losses that agree across compile and
layouts) and how fast is it (tokens/s, TFLOP/s, MFU against the detected peak)?

    python -m benchmarks.gpu_check [--micro-batch 8] [--steps 20] [--out runs/gpu_check]
    bash benchmarks/gpu_check.sh          # the same, refusing to start without a CUDA device

Every row is a fresh `python -m nanotron.train` of the ~1.1B model (TinyLlama's shape, seq 2048, bf16) on
a synthetic corpus, with a warm-up and a sane LR (3e-4, cosine to 3e-5), and the same global batch so
that losses compare step by step. One device: compile off and on, compile with selective recompute (every
matmul output kept, and every other one), and a checkpoint saved mid-run in each `checkpoint.async_mode` (sync,
async, async_pinned: the step's stall, `save_stall_sec`). With two or more: dp2 (NCCL, FSDP2 ZeRO-3, async_pinned
checkpoints every `steps/2` steps), a resume from the middle checkpoint, and tp2 with compile and async TP, and cp2
(ring attention over NCCL). Then, on one device, context parallelism's attention (`benchmarks/cp_check.py`: the
matmul path in float64, then the fused CUDA block kernels, flash and memory-efficient, against float64 at cp 2/4;
then speed and peak memory against SDPA at 8k, 32k and 128k tokens) and the experts' grouped GEMM
(`benchmarks/moe.py`'s kernel check: padded and unpadded groups against the loop at 8 and 64 experts, then speed).
Each row is checked, and the command exits 1 if any check fails:
- every loss finite, and the last loss below the first by at least 1 nat (the model learns);
- compile, compile selective (both policies), dp2, tp2, cp2: step-1 loss within 1e-3 and the last 5 within 2e-2
  (relative) of the eager 1-device row (bf16 noise; a lost gradient is off by far more);
- float8 tensorwise and rowwise (compile, one device): step-1 loss within 1e-2 and the last 5 within 3e-2 of the
  eager bf16 row (float8's own error; a first guess to calibrate); dp2 float8 all-gather (FSDP2, ZeRO-3, tensorwise)
  within the bf16 tolerances of the 1-device float8 row;
- muon (optimizer.name = "muon", AdamW's lr): learns on one device; its step time against bf16 eager's is printed,
  then (`optimizer_step_line`, in this process) the optimizer step alone, Muon's (Newton-Schulz in fp32: the code
  has no bf16 iteration) against AdamW's fused one, each as a share of forward + backward of one micro-batch;
- qwen3 (QK-norm, head_dim 128): learns on one device; qwen3 tp2 sp within the bf16 tolerances of it;
- checkpoint sync/async/async_pinned: within the bf16 tolerances of eager (saving changes no math);
- mla (DeepSeek-V3's multi-head latent attention at the 1B width): learns on one device; mla tp2 sp within the bf16
  tolerances of it;
- resume: the resumed steps within 1e-3 of the same steps of the uninterrupted dp2 row;
- tp2 async: no "unavailable" warning, i.e. async TP really ran;
- host syncs: one device, in this process: steps 2-4 of 5 (not logged) under torch.cuda.set_sync_debug_mode("error")
  except inside the step agreement, the step's one intended host sync (issue 47; on CPU tests/test_train.py counts).
`--quick` runs a nano model on CPU (gloo for the 2-rank rows, no compile): the script's own smoke test.
`--only rows` runs the training rows and the kernel checks, `--only watch` the doctor and hang checks (rerun one
half after fixing it; the test suite runs the two halves separately, the watch half alone on the machine).
Writes gpu_check.csv/.md to --out; speed is the median over the steps after --warmup.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (
    REPO,
    bench_env,
    bench_parser,
    ensure_data,
    launch_nanotron,
    median_after_warmup,
    model_overrides,
    write_table,
)

COLUMNS = (
    "check",
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


MOE = [  # each expert a quarter of the dense MLP (1b: 1408 = 5632 / 4; nano: 32)
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.router=sigmoid",
    "--model.moe.bias_update_rate=0.001",
]

MLA = [
    "--model.q_lora_rank=512",
    "--model.kv_lora_rank=256",
    "--model.qk_nope_head_dim=64",
    "--model.qk_rope_head_dim=32",
    "--model.v_head_dim=64",
]


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
    problems: list[str] = field(default_factory=list)


def checks(settings: argparse.Namespace, n_devices: int) -> list[Check]:
    compile_ = [] if settings.quick else [Check("bf16 compile", 1, ["--training.compile=true"], "bf16 eager")]
    # Selective activation checkpointing under compile (torchtitan's default pairing): its speed and memory
    # against the compile row, its losses against eager.
    selective = ["--training.compile=true", "--parallelism.recompute=selective"]
    compile_ += [] if settings.quick else [Check("bf16 compile selective", 1, selective, "bf16 eager")]
    # torchtitan's op-level policy (every other matmul kept), its default under compile.
    every_other = [*selective, "--parallelism.selective_matmuls=every_other"]
    compile_ += [] if settings.quick else [Check("bf16 compile selective every_other", 1, every_other, "bf16 eager")]
    # A mixture of experts of the same shape (8 experts, top 2, each a quarter of the MLP): the grouped GEMM path.
    moe = [*MOE, f"--model.moe.moe_intermediate_size={32 if settings.quick else 1408}"]
    rows = [Check("bf16 eager", 1, []), *compile_, *float8_checks(settings), Check("moe bf16", 1, moe)]
    # Muon (AdamW's lr carries over: Moonlight's scaling) must learn too; its step time is set against bf16 eager's.
    rows.append(Check("muon bf16", 1, ["--optimizer.name=muon"]))
    # Qwen3's attention (QK-norm, head_dim 128 apart from hidden / heads): finite falling losses on one device,
    # and sequence-parallel TP held to it on two (the norm's replicated weight, its gradient summed over tp).
    qwen3 = [] if settings.quick else ["--model.qk_norm=true", "--model.head_dim=128"]
    rows += [Check("qwen3 bf16", 1, qwen3)] if qwen3 else []
    # DeepSeek-V3's multi-head latent attention at the 1B width (32 heads of 64 + 32 for queries/keys and 64 for
    # values from latents of 512 and 256): learns on one device, and sequence-parallel TP held to it on two (heads
    # split, the latents' down-projections replicated, the shared RoPE key's gradient summed over tp).
    mla = [] if settings.quick else [*MLA, "--model.num_kv_heads=32"]
    rows += [Check("mla bf16", 1, mla)] if mla else []
    rows += checkpoint_checks(settings)
    if n_devices < 2:
        return rows
    half = settings.steps // 2
    pinned = "async" if settings.quick else "async_pinned"  # CPU has no pinned memory (refused there)
    saving = [f"--checkpoint.interval={half}", f"--checkpoint.async_mode={pinned}", "--checkpoint.keep_last=0"]
    rows += [
        Check("dp2 fsdp2", 2, ["--parallelism.dp=2", "--parallelism.zero_stage=3", *saving], "bf16 eager"),
        Check("dp2 resumed", 2, ["--parallelism.dp=2", "--parallelism.zero_stage=3"], resume_of="dp2 fsdp2"),
        Check("cp2 ring", 2, ["--parallelism.cp=2"], "bf16 eager"),  # the ring over NCCL p2p
        Check("moe ep2", 2, [*moe, "--parallelism.dp=2", "--parallelism.ep=2"], "moe bf16"),  # NCCL all-to-all
    ]
    if not settings.quick:
        # FSDP2's float8 all-gather (tensorwise) with its per-step scale precompute, against the 1-device float8 row.
        float8_dp2 = [
            "--parallelism.dp=2",
            "--parallelism.zero_stage=3",
            *FLOAT8_COMPILE,
            "--training.float8=tensorwise",
        ]
        rows.append(Check("dp2 float8 all-gather", 2, float8_dp2, "float8 tensorwise compile"))
        async_tp = ["--parallelism.tp=2", "--training.compile=true", "--parallelism.tp_linear_async_communication=true"]
        rows.append(Check("tp2 compile async", 2, async_tp, "bf16 eager", async_tp=True))
        rows.append(Check("qwen3 tp2 sp", 2, [*qwen3, "--parallelism.tp=2"], "qwen3 bf16"))
        rows.append(Check("mla tp2 sp", 2, [*mla, "--parallelism.tp=2"], "mla bf16"))
    return rows


def checkpoint_checks(settings: argparse.Namespace) -> list[Check]:
    """The training step's stall when a checkpoint is saved mid-run, per checkpoint.async_mode (one device): the
    step after the save against the median step. sync: the whole write; async: the copy to pageable host memory;
    async_pinned: the copy to pinned memory, overlapped. Losses held to bf16 eager (saving changes no math). Not
    in --quick (CPU has no pinned memory; tests/test_checkpoint.py covers the modes there)."""
    if settings.quick:
        return []
    half = settings.steps // 2
    return [
        Check(
            f"checkpoint {mode}",
            1,
            [f"--checkpoint.interval={half}", f"--checkpoint.async_mode={mode}", "--checkpoint.keep_last=0"],
            "bf16 eager",
            save_step=half,
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
    if settings.quick:
        return []
    return [
        Check(
            f"float8 {recipe} compile",
            1,
            [*FLOAT8_COMPILE, f"--training.float8={recipe}"],
            "bf16 eager",
            tolerance=FLOAT8_TOLERANCE,
        )
        for recipe in ("tensorwise", "rowwise")
    ]


def run_check(check: Check, settings: argparse.Namespace, common: list[str], done: dict[str, dict]) -> dict:
    name = "gpu_check-" + check.name.replace(" ", "_")
    args = [*common, *check.overrides]
    if check.resume_of is not None:
        saved = settings.work_dir / "runs" / done[check.resume_of]["run"] / "checkpoints"
        args.append(f"--checkpoint.resume_from={saved / f'step-{settings.steps // 2}'}")
    start = time.perf_counter()
    proc, run_dir = launch_nanotron(name, args, check.nproc, settings.work_dir)
    stdout, stderr = proc.communicate(timeout=settings.timeout)
    records = _records(run_dir)
    row = {"check": check.name, "run": name, "world": check.nproc, "seconds": time.perf_counter() - start}
    if proc.returncode != 0 or not records:
        check.problems.append(f"run failed (exit {proc.returncode}): {stderr.strip().splitlines()[-1:]}")
        print(stdout[-3000:], stderr[-5000:], sep="\n", file=sys.stderr)
        return row | {"losses": {}}
    losses = {r["step"]: r["loss"] for r in records}
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


def watch_checks(common: list[str], n_devices: int, settings: argparse.Namespace) -> bool:
    """`nanotron doctor` on the visible devices: a healthy run passes (exit 0, its table printed) and an injected
    wrong matmul on rank 0 is caught (exit 2: named, but with one node a requeue without it would have no node
    left, so a person looks): the checksum and fp64-reference checks on the device's own math.
    With two devices or more, also a hang on NCCL (rank 1 sleeps in data at step 3): the watcher must name it."""
    base = ["--nproc_per_node", str(n_devices), "--config", "configs/tiny.toml"]  # after `python -m nanotron CMD`
    base += [arg for arg in common if arg.startswith(("--training.device", "--data."))]
    base += [f"--job.out_dir={settings.work_dir / 'runs'}", f"--parallelism.dp={n_devices}"]
    runs = [("doctor", "", 0, "doctor: "), ("doctor", "rank:0,step:0,kind:bad_matmul", 2, "doctor: rank 0 ")]
    if n_devices > 1:
        runs.append(("train", "rank:1,step:3,kind:sleep", 75, "hang: rank 1 "))
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
    if n_devices > 1 and "--training.device=cuda" in common:
        ok &= nccl_dump_on_timeout(base, settings)
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
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check", help="folder for gpu_check.csv/.md")
    parser.add_argument("--work-dir", type=Path, default=REPO / ".cache" / "gpu_check", help="corpus and run dirs")
    settings = parser.parse_args(argv)
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
    print(f"device: {name} x {n_devices}; bf16 dense peak {peak or 'unknown'} TFLOP/s per device", flush=True)
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
    failed = False
    if settings.only != "watch":
        failed |= not training_checks(settings, common, device, name, peak, n_devices)
    if settings.only != "rows":
        failed |= not watch_checks(common, n_devices, settings)
    for checkpoints in (settings.work_dir / "runs").glob("*/checkpoints"):
        shutil.rmtree(checkpoints)  # 1B checkpoints with optimizer state: ~13 GB each
    return 1 if failed else 0


def training_checks(
    settings: argparse.Namespace, common: list[str], device: str, name: str, peak: float | None, n_devices: int
) -> bool:
    """The training rows (gpu_check.csv/.md), then context parallelism's and the experts' kernels."""
    done: dict[str, dict] = {}
    rows, failed = [], False
    for check in checks(settings, n_devices):
        row = run_check(check, settings, common, done)
        verify(check, row, done)
        row |= {"device": name, "peak_tflops": peak or 0.0, "verdict": "; ".join(check.problems) or "ok"}
        done[check.name] = row
        rows.append(row)
        failed |= bool(check.problems)
        print(
            f"{check.name:20s} {row.get('tokens_per_sec', 0):10.0f} tokens/s {row.get('tflops', 0):8.1f} TFLOP/s "
            f"MFU {100 * row.get('mfu', 0):5.1f}%  loss {row.get('first_loss', math.nan):.3f} -> "
            f"{row.get('last_loss', math.nan):.3f}  ({row['seconds']:.0f} s)  "
            + (f"save stall {row['save_stall_sec']:.2f} s  " if "save_stall_sec" in row else "")
            + row["verdict"],
            flush=True,
        )
    print(write_table(rows, COLUMNS, settings.out / "gpu_check"))
    print(optimizer_line(done), flush=True)
    print(optimizer_step_line(settings, device), flush=True)
    from benchmarks.cp_check import check as cp_attention_check

    cp_seq_lens = (256,) if settings.quick else (8192, 32768, 131072)
    failed |= not cp_attention_check(device, cp_seq_lens)  # the CUDA block kernels, one device
    from benchmarks.moe import kernel_check

    failed |= not kernel_check(device)  # the experts' grouped GEMM against the loop
    if device == "cuda":
        failed |= not host_sync_check(common, settings)
    return not failed


def optimizer_line(done: dict[str, dict]) -> str:
    """Muon's step time against AdamW's on one device (the same model, batch and steps): the orthogonalisation's
    cost, all of it on the one rank here."""
    muon, adamw = (done.get(name, {}).get("step_time_sec") for name in ("muon bf16", "bf16 eager"))
    if not muon or not adamw:
        return "optimizer: muon or adamw row missing, no step time comparison"
    return f"optimizer: muon step {muon:.3f}s vs adamw {adamw:.3f}s ({muon / adamw:.2f}x) on one device"


def optimizer_step_line(settings: argparse.Namespace, device: str) -> str:
    """Muon's optimizer step alone against AdamW's on one device, the model of the rows (fp32 master weights, bf16
    autocast on CUDA), medians of 5 steps after 2 (`benchmarks.muon_quality.step_share`): the orthogonalisation's
    own time, which the whole-step comparison above mixes with forward and backward."""
    import torch

    from benchmarks.muon_quality import step_share

    micro = settings.micro_batch
    overrides = [
        *model_overrides("nano" if settings.quick else "1b"),
        f"--training.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
        f"--training.micro_batch_size={micro}",
        f"--training.global_batch_size={micro}",
    ]
    rows = {name: step_share(overrides, name, repeats=5, device=device) for name in ("adamw", "muon")}
    if device == "cuda":
        torch.cuda.empty_cache()
    adamw, muon = rows["adamw"], rows["muon"]
    return (
        f"optimizer step alone: muon {muon['optimizer_step_s']:.4f}s vs adamw {adamw['optimizer_step_s']:.4f}s; "
        f"share of a step of one micro-batch of {micro}: muon {100 * muon['share']:.1f}%, "
        f"adamw {100 * adamw['share']:.1f}% (forward + backward {muon['forward_backward_s']:.3f}s)"
    )


def host_sync_check(common: list[str], settings: argparse.Namespace) -> bool:
    """A step makes the host wait for the GPU once, in the step agreement (`ParallelContext.agree`): a 5-step run on
    one device in this process, logging only steps 1 and 5, with every other sync of steps 2-4 (their ends
    included) an error."""
    import torch

    from nanotron.config import load_config, parse_overrides
    from nanotron.parallel.mesh import destroy_distributed
    from nanotron.trainer import Trainer

    run = [f"--job.out_dir={settings.work_dir / 'runs'}", "--job.name=gpu_check-host_syncs"]
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
        trainer.close()
        destroy_distributed()
        torch.cuda.empty_cache()
    print(f"host syncs per step: {'1 (the step agreement)' if problem is None else problem}", flush=True)
    return problem is None


if __name__ == "__main__":
    sys.exit(main())
