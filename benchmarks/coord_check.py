"""Coordinate check of the µP benchmarks' model family: `nanotron coord-check` with this repo's presets.

    python -m benchmarks.coord_check [--steps 10] [--seeds 3] [--lr 0.004] [--quick] [--out DIR]

A thin caller of `nanotron coord-check` (nanotron/coord_check: the statistics, the slope verdict, the table and
figures), at one process on the CPU: widths 64 -> 512 at 4 layers and depths 4 -> 32 at width 128 (the preset's
MLP ratio 3 and 4 heads, so the head dim grows with the width), batch 8 x 64 tokens, on the Shakespeare corpus
of `make data` (synthetic text with --quick: widths 32, 64, depths 1, 2, 2 steps, one seed). Writes
coord_check.csv, coord_check.md and coord-check-{width,depth}-{size,change,update}.png to --out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.common import DEFAULT_WORK_DIR, FORK_LAUNCHER, RESULTS_DIR, bench_parser, forked_subprocess
from benchmarks.inprocess import corpus_overrides


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("coord_check", __doc__)
    parser.add_argument("--widths", default="64,128,256,512", help="width sweep (4 layers); the first is µP's base")
    parser.add_argument("--depths", default="4,8,16,32", help="depth sweep (width 64); the first is µP's base")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (statistics every step)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per point (error bars; the slopes use means)")
    parser.add_argument("--lr", type=float, default=2**-8, help="the one (constant) learning rate")
    parser.add_argument("--quick", action="store_true", help="2 widths, 2 depths, 2 steps, synthetic text")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.depths, args.steps, args.seeds = "32,64", "1,2", 2, 1
    from nanotron.commands.coord_check import main as coord_check
    from nanotron.coord_check import runs

    if os.environ.get(FORK_LAUNCHER):  # the test suite's smoke run: the member runs forked, not executed
        runs.subprocess = forked_subprocess

    status = coord_check(
        [
            *("--widths", args.widths, "--depths", args.depths, "--steps", str(args.steps)),
            *("--seeds", str(args.seeds), "--out", str(args.out), "--work-dir", str(args.work_dir / "coord-check")),
            *corpus_overrides(args.work_dir, args.quick),
            "--training.device=cpu",
            "--model.vocab_size=1024",
            "--model.max_seq_len=64",
            "--training.seq_len=64",
            "--training.micro_batch_size=8",
            "--training.global_batch_size=8",
            "--training.eval_steps=2",
            f"--optimizer.lr={args.lr}",
            "--logging.peak_tflops=1",
        ]
    )
    return 0 if status == 1 else status  # 1: µP's slopes not all flat, a result (coord_check.md), not a failure


if __name__ == "__main__":
    sys.exit(main())
