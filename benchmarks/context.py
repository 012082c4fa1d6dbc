"""Context parallelism measured: activation memory per rank at cp 1/2/4, the planner against it, and tokens/s.

    python -m benchmarks.context [--seq-len 16384] [--quick]

Memory: each layout is a real run of the tiny model (benchmarks.common "tiny": hidden 128, 4 layers, GQA 4/2
heads, vocab 8192) at `--seq-len` tokens per sample, one sample per step, two steps, under
`benchmarks/probe.py` (the storages autograd saves for backward, the peak over the step, on the worst rank)
via `benchmarks.memory`'s worker; `plan_err` = `nanotron plan`'s activation estimate / measured - 1. Peak
RSS growth is the rank's resident set at its peak over its size before building anything.

Speed: tokens/s of cp 2 on 2 ranks against cp 1 on 1 rank at `--speed-seq-len`, rounds interleaved (the 2
shared cores are noisy), read from each run's metrics.jsonl (steps after the first). The K/V bytes each rank
sends per step are counted from the shapes (what the ring sends: K/V forward cp-1 times, K/V and fp32 dK/dV
backward), the same formula as `nanotron plan`'s cp traffic.
"""

from __future__ import annotations

import json
import statistics
import subprocess
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
    train_command,
    write_table,
)
from benchmarks.memory import estimate_errors, measure

MIB = 2**20
TARGETS = {1: None, 2: 0.55, 4: 0.3}  # activation memory per rank / cp 1's


def shape_args(seq_len: int) -> list[str]:
    return [
        *model_overrides("tiny"),
        f"--model.max_seq_len={seq_len}",
        f"--training.seq_len={seq_len}",
        "--training.micro_batch_size=1",
        "--training.grad_accum_steps=1",
        "--training.global_batch_size=0",
    ]


def memory_rows(seq_len: int, cps: list[int], work_dir: Path, data: list[str]) -> list[dict]:
    base = [*QUIET_RUN, *data, *shape_args(seq_len), "--training.steps=2"]
    rows, reference = [], None
    for cp in cps:
        overrides = [f"--parallelism.cp={cp}"]
        ranks = measure(f"cp{cp}-seq{seq_len}", overrides, base, work_dir)
        activation = max(r["activation_bytes"] for r in ranks)
        reference = reference or activation
        ratio, target = activation / reference, TARGETS.get(cp)
        errors = estimate_errors(ranks, [*base, *overrides])
        rows.append(
            {
                "layout": f"cp{cp}",
                "seq_len": seq_len,
                "world": cp,
                "activation_mib": activation / MIB,
                "vs_cp1": ratio,
                "target": f"<= {target}" if target else "",
                "met": ("yes" if ratio <= target else "NO") if target else "",
                "plan_err": errors["activation_err"],
                "peak_growth_gib": max(r["peak_growth_gib"] for r in ranks),
            }
        )
        print(f"  cp{cp} seq {seq_len}: activations {activation / MIB:.1f} MiB/rank x{ratio:.3f}", flush=True)
    return rows


def ring_bytes_per_step(seq_len: int, cp: int) -> float:
    """What one rank's ring sends per step for the tiny model, fp32, one sample: K/V forward (cp-1)x,
    backward K/V (cp-1)x and fp32 dK/dV cp x, per layer."""
    from benchmarks.common import MODELS

    m = MODELS["tiny"]
    kv_block = 2 * (seq_len // cp) * m["num_kv_heads"] * (m["hidden_size"] // m["num_heads"]) * 4
    return 0.0 if cp == 1 else m["num_layers"] * ((cp - 1) * kv_block * 2 + cp * kv_block)


def speed_rows(seq_len: int, rounds: int, steps: int, work_dir: Path, data: list[str]) -> list[dict]:
    base = [*QUIET_RUN, *data, *shape_args(seq_len), f"--training.steps={steps}", f"--job.out_dir={work_dir / 'runs'}"]
    samples: dict[int, list[float]] = {1: [], 2: []}
    for round_ in range(rounds):
        for cp in (1, 2):
            name = f"cp-speed-{cp}-{round_}"
            cmd = train_command(cp, [*base, f"--parallelism.cp={cp}", f"--job.name={name}"])
            subprocess.run(cmd, cwd=REPO, env=bench_env(), check=True, capture_output=True, timeout=1800)
            metrics = work_dir / "runs" / name / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]
            samples[cp].append(statistics.median(rates))
    one = statistics.median(samples[1])
    return [
        {
            "layout": f"cp{cp} on {cp} rank(s)",
            "seq_len": seq_len,
            "tokens_per_s": statistics.median(samples[cp]),
            "vs_cp1": statistics.median(samples[cp]) / one,
            "rounds": " ".join(f"{s:.0f}" for s in samples[cp]),
            "ring_mib_per_rank_step": ring_bytes_per_step(seq_len, cp) / MIB,
        }
        for cp in (1, 2)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("context", __doc__)
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per sample for the memory runs")
    parser.add_argument("--speed-seq-len", type=int, default=4096, help="tokens per sample for the speed runs")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds")
    parser.add_argument("--quick", action="store_true", help="smoke-test settings: short sequences, one round")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for context_*.csv/.md")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="synthetic data and run dirs")
    args = parser.parse_args(argv)
    seq, speed_seq, rounds, steps = args.seq_len, args.speed_seq_len, args.rounds, 4
    if args.quick:
        seq, speed_seq, rounds, steps = 512, 256, 1, 3
    data = ensure_data(args.work_dir, n_docs=max(1200, 8 * seq // 200))
    memory = memory_rows(seq, [1, 2, 4], args.work_dir, data)
    print(write_table(memory, list(memory[0]), args.out / "context_memory"))
    speed = speed_rows(speed_seq, rounds, steps, args.work_dir, data)
    print(write_table(speed, list(speed[0]), args.out / "context_speed"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
