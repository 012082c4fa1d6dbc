"""Mixture of experts measured: load balance, expert-parallel speed and the all-to-all's share, memory vs the plan.

    python -m benchmarks.moe [--steps 200] [--rounds 3] [--quick]

Balance: `configs/moe.toml` (8 experts, top 2, sigmoid router) on the demo corpus for `--steps` steps, with its
auxiliary-loss-free bias balancing and with it off (`model.moe.bias_update_rate=0`): the worst layer's max/mean
tokens per expert over a step (`moe/load_max_over_mean`), at the last step and over the last 50.

Speed: the same model at ep1 x dp2 and ep2 x dp2 on 2 ranks, rounds interleaved (the 2 shared cores are noisy),
tokens/s from metrics.jsonl (steps after the first), and the share of the step the ranks spend inside the expert
all-to-alls (counts and tokens, forward and backward): every `all_to_all_single` call timed by a worker that wraps
it and runs the real trainer.

Kernel (`kernel_check`, from `benchmarks/gpu_check.sh`): the experts' grouped GEMM (padded groups, and unpadded
offsets where the kernel takes them) at 8 and 64 experts against the per-expert
loop, numerics then speed.

Memory: MoE layouts through `benchmarks.memory`'s probe (the real Trainer, what each rank holds) against
`nanotron plan`'s estimate per part (`*_err` = estimate / measured - 1) and in total (`total_err`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    QUIET_RUN,
    REPO,
    RESULTS_DIR,
    bench_env,
    bench_parser,
    ensure_data,
    parse_or_work,
    write_table,
)
from benchmarks.memory import ESTIMATED, estimate_errors, measure

MIB = 2**20
CONFIG = str(REPO / "configs" / "moe.toml")
# The MoE of configs/moe.toml on the benchmark's synthetic corpus (vocab 1024): 8 experts, top 2, shared expert.
MOE_MODEL = [
    "--model.hidden_size=128",
    "--model.intermediate_size=384",
    "--model.num_layers=4",
    "--model.num_heads=4",
    "--model.num_kv_heads=2",
    "--model.vocab_size=1024",
    "--model.max_seq_len=128",
    "--training.seq_len=128",
    "--model.moe.num_experts=8",
    "--model.moe.top_k=2",
    "--model.moe.moe_intermediate_size=96",
    "--model.moe.num_shared_experts=1",
    "--model.moe.first_dense_layers=1",
    "--model.moe.router=sigmoid",
    "--model.moe.bias_update_rate=0.01",
]
MEMORY_LAYOUTS = [
    ("moe 1 process", []),
    ("moe dp2 ep2 zero1", ["--parallelism.dp=2", "--parallelism.ep=2", "--parallelism.zero_stage=1"]),
    ("moe dp2 ep2 zero3", ["--parallelism.dp=2", "--parallelism.ep=2", "--parallelism.zero_stage=3"]),
    ("moe dp2 ep1 zero1", ["--parallelism.dp=2", "--parallelism.zero_stage=1"]),
]


def load_ratios(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["moe/load_max_over_mean"] for r in records if "moe/load_max_over_mean" in r]


def balance_rows(steps: int, work_dir: Path) -> list[dict]:
    rows = []
    for name, rate in (("bias balancing (rate 0.01)", "0.01"), ("no balancing", "0")):
        job = f"moe-balance-{rate}"
        args = [
            "--config",
            CONFIG,
            f"--job.out_dir={work_dir / 'runs'}",
            f"--job.name={job}",
            f"--training.steps={steps}",
            f"--model.moe.bias_update_rate={rate}",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            "--training.eval_interval=0",
            "--logging.log_interval=1",
            "--logging.tensorboard=false",
            "--checkpoint.resume_from=none",
        ]
        subprocess.run(
            [sys.executable, "-m", "nanotron.train", *args],
            cwd=REPO,
            env=bench_env(2),
            check=True,
            capture_output=True,
            timeout=3600,
        )
        ratios = load_ratios(work_dir / "runs" / job)
        rows.append(
            {
                "run": name,
                "steps": steps,
                "load_max_over_mean_first": ratios[0],
                "load_max_over_mean_last": ratios[-1],
                "mean_last_50": statistics.mean(ratios[-50:]),
                "target": "<= 1.5" if rate != "0" else "",
                "met": ("yes" if ratios[-1] <= 1.5 else "NO") if rate != "0" else "",
            }
        )
        print(f"  {name}: max/mean load {ratios[0]:.2f} -> {ratios[-1]:.2f}", flush=True)
    return rows


def worker(args: list[str], out: Path) -> None:
    """One rank: the real trainer with every all_to_all_single timed (only expert parallelism calls it)."""
    import torch.distributed as dist

    from nanotron.config import load_config, parse_overrides
    from nanotron.launch.torchrun import launched_world_size
    from nanotron.parallel.mesh import destroy_distributed
    from nanotron.trainer import Trainer

    spent = [0.0, 0]
    original = dist.all_to_all_single

    def timed(*a, **k):
        start = time.perf_counter()
        result = original(*a, **k)
        spent[0] += time.perf_counter() - start
        spent[1] += 1
        return result

    dist.all_to_all_single = timed
    cfg = load_config(*parse_overrides(args), world_size=launched_world_size())
    trainer = Trainer(cfg)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    record = {"rank": trainer.ctx.rank, "all_to_all_s": spent[0], "calls": spent[1], "train_s": total}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if trainer.ctx.rank == 0:
        out.write_text(json.dumps(records))
    trainer.close()
    destroy_distributed()


def speed_rows(rounds: int, steps: int, work_dir: Path, data: list[str]) -> list[dict]:
    base = [*QUIET_RUN, *data, *MOE_MODEL, f"--training.steps={steps}", f"--job.out_dir={work_dir / 'runs'}"]
    base += ["--parallelism.dp=2", "--training.micro_batch_size=4", "--training.global_batch_size=16"]
    base += ["--training.grad_accum_steps=0"]
    samples: dict[int, list[float]] = {1: [], 2: []}
    shares: dict[int, list[float]] = {1: [], 2: []}
    for round_ in range(rounds):
        for ep in (1, 2):
            name = f"moe-speed-ep{ep}-{round_}"
            out = work_dir / "runs" / f"{name}.json"
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            cmd = [*launcher, "-m", "benchmarks.moe", "--worker", "--out", str(out), *base]
            cmd += [f"--parallelism.ep={ep}", f"--job.name={name}"]
            subprocess.run(cmd, cwd=REPO, env=bench_env(), check=True, capture_output=True, timeout=3600)
            records = [
                json.loads(line) for line in (work_dir / "runs" / name / "metrics.jsonl").read_text().splitlines()
            ]
            rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]
            samples[ep].append(statistics.median(rates))
            ranks = json.loads(out.read_text())
            shares[ep].append(max(r["all_to_all_s"] / r["train_s"] for r in ranks))
    one = statistics.median(samples[1])
    return [
        {
            "layout": f"ep{ep} x dp2 (2 ranks)",
            "tokens_per_s": statistics.median(samples[ep]),
            "vs_ep1": statistics.median(samples[ep]) / one,
            "all_to_all_share": statistics.median(shares[ep]),
            "rounds": " ".join(f"{s:.0f}" for s in samples[ep]),
        }
        for ep in (1, 2)
    ]


def memory_rows(work_dir: Path, data: list[str]) -> list[dict]:
    from nanotron.config import load_config, parse_overrides
    from nanotron.plan.memory import stage_memory

    base = [*QUIET_RUN, *data, *MOE_MODEL, "--training.steps=2", "--training.micro_batch_size=2"]
    base += ["--training.grad_accum_steps=4", "--training.global_batch_size=0"]
    rows = []
    for name, overrides in MEMORY_LAYOUTS:
        ranks = measure(name.replace(" ", "-"), overrides, base, work_dir)
        errors = estimate_errors(ranks, [*base, *overrides])
        cfg = load_config(*parse_overrides([*base, *overrides]))
        measured = max(sum(r[key] for key, _, _ in ESTIMATED) for r in ranks)
        planned = max(
            sum(stage_memory(cfg, r["pp_rank"])[part] for _, parts, _ in ESTIMATED for part in parts) for r in ranks
        )
        rows.append(
            {
                "layout": name,
                "measured_mib": measured / MIB,
                "planned_mib": planned / MIB,
                "total_err": planned / measured - 1,
                **errors,
                "target": "within 25%",
                "met": "yes" if abs(planned / measured - 1) <= 0.25 else "NO",
            }
        )
        print(f"  {name}: measured {measured / MIB:.1f} MiB, plan {planned / MIB:.1f} MiB", flush=True)
    return rows


def kernel_check(device: str) -> bool:
    """The experts' grouped GEMM (torch's, bf16, over groups padded to 8 rows) against the per-expert loop, forward
    and backward, at 8 and 64 experts with empty experts and uneven groups; then forward+backward speed of both
    and of the grouped GEMM over unpadded offsets (or the kernel's refusal of them). One line per expert count;
    False when the numbers disagree. On CPU (the smoke test) the same at a tiny size."""
    import torch

    from nanotron.models.moe import expert_mlp
    from nanotron.parallel.expert import aligned_grouped_matmul, padded_grouped_mlp

    def unpadded(x, counts, gate_up, down):
        return expert_mlp(x, counts, gate_up, down, aligned_grouped_matmul)

    ok = True
    hidden, inter, tokens = (2048, 1408, 16384) if device == "cuda" else (64, 48, 512)  # 1b MoE row; tokens x top 2
    for experts in (8, 64):
        g = torch.Generator(device=device).manual_seed(experts)
        share = torch.rand(experts, device=device, generator=g) * (torch.arange(experts, device=device) % 5 != 1)
        counts = (share / share.sum() * tokens).long()  # every 5th expert empty, the rest uneven
        x = torch.randn(int(counts.sum()), hidden, device=device, generator=g).bfloat16().requires_grad_()
        weights = [
            (torch.randn(experts, *shape, device=device, generator=g) * 0.03).bfloat16().requires_grad_()
            for shape in ((2 * inter, hidden), (hidden, inter))
        ]
        dout = torch.randn(x.shape, device=device, generator=g).bfloat16()
        results, times = {}, {}
        for name, mlp in (("loop", expert_mlp), ("grouped", padded_grouped_mlp), ("unpadded", unpadded)):
            try:
                out = mlp(x, counts, *weights)
                results[name] = [out, *torch.autograd.grad(out, [x, *weights], dout)]
                leaves = [x, *weights]
                step = (
                    lambda mlp=mlp, leaves=leaves, counts=counts, dout=dout: torch.autograd.grad(  # noqa: E731
                        mlp(leaves[0], counts, *leaves[1:]), leaves, dout
                    )
                )
                times[name] = _time_ms(step, device)
            except RuntimeError as error:  # the kernel may refuse unaligned groups
                times[name] = f"refused ({str(error).splitlines()[0][:80]})"
        errors = {
            name: max(
                ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()
                for a, b in zip(results[name], results["loop"])
            )
            for name in ("grouped", "unpadded")
            if name in results
        }
        good = errors.get("grouped", float("inf")) <= 2e-2  # bf16 accumulation order
        ok &= good
        speed = ", ".join(f"{n} {t:.2f} ms" if isinstance(t, float) else f"{n} {t}" for n, t in times.items())
        print(
            f"moe grouped GEMM ({device}, {experts} experts, {tokens} rows): relative error vs the loop (out, dx, dW) "
            f"padded {errors.get('grouped', float('nan')):.2e}, unpadded {errors.get('unpadded', float('nan')):.2e}; "
            f"forward+backward {speed}  {'ok' if good else 'FAILED'}",
            flush=True,
        )
    return ok


def _time_ms(fn, device: str, rounds: int = 10) -> float:
    """Median ms of fn() after one warm-up call."""
    import torch

    times = []
    for _ in range(rounds + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("moe", __doc__)
    parser.add_argument("--steps", type=int, default=200, help="steps of configs/moe.toml for the balance runs")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds")
    parser.add_argument("--only", choices=("balance", "speed", "memory"), help="run one part")
    parser.add_argument("--quick", action="store_true", help="smoke-test settings: few steps, one round")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for moe_*.csv/.md")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="synthetic data and run dirs")
    args = parse_or_work(parser, argv, worker)
    steps, rounds, speed_steps = (args.steps, args.rounds, 8) if not args.quick else (6, 1, 3)
    data = ensure_data(args.work_dir)
    if args.only in (None, "balance"):
        rows = balance_rows(steps, args.work_dir)
        print(write_table(rows, list(rows[0]), args.out / "moe_balance"))
    if args.only in (None, "speed"):
        rows = speed_rows(rounds, speed_steps, args.work_dir, data)
        print(write_table(rows, list(rows[0]), args.out / "moe_speed"))
    if args.only in (None, "memory"):
        rows = memory_rows(args.work_dir, data)
        print(write_table(rows, list(rows[0]), args.out / "moe_memory"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
