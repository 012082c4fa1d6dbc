"""Exit-code stress check: many short multi-rank runs must all exit 0.

    python -m benchmarks.exit_stress [--runs 30] [--layouts dp2,pp2]

A finished gloo run with DeviceMesh sub-groups used to abort at interpreter exit in about 1 of 4 runs
(`terminate called without an active exception`, exit -6 on one rank, torchrun exit 1): gloo threads
still held work while Python finalised. nanotron.train now flushes and ends with `os._exit` after a clean
teardown (`errors.exit_process`). Runs end without a final checkpoint, the case that aborted most often.
Prints one row per layout: runs, exit codes seen, and the first failing output if any.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    QUIET_RUN,
    REPO,
    bench_env,
    bench_parser,
    ensure_data,
    model_overrides,
    train_command,
)

LAYOUTS = {"dp2": ["--parallelism.dp=2"], "pp2": ["--parallelism.pp=2"], "tp2": ["--parallelism.tp=2"]}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("exit_stress", __doc__)
    parser.add_argument("--runs", type=int, default=30, help="runs per layout")
    parser.add_argument("--layouts", default="dp2,pp2", help=f"comma-separated, among {', '.join(LAYOUTS)}")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args(argv)

    base = [*QUIET_RUN, *ensure_data(args.work_dir), *model_overrides("nano"), "--training.steps=3"]
    base += ["--training.micro_batch_size=2", "--training.global_batch_size=8", "--training.grad_accum_steps=0"]
    base += ["--checkpoint.save_final=false", f"--job.out_dir={args.work_dir / 'runs'}"]
    failed = False
    for layout in args.layouts.split(","):
        codes: collections.Counter[int] = collections.Counter()
        first_failure = ""
        for run in range(args.runs):
            cmd = train_command(2, [*base, f"--job.name=exit-{layout}-{run}", *LAYOUTS[layout]])  # plain torchrun
            proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=600)
            codes[proc.returncode] += 1
            if proc.returncode != 0 and not first_failure:
                first_failure = (proc.stdout + proc.stderr)[-1500:]
        failed |= set(codes) != {0}
        print(f"{layout}: {args.runs} runs, exit codes {dict(codes)}", flush=True)
        if first_failure:
            print(f"  first failure:\n{first_failure}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
