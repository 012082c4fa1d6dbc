"""Time to the first training step, fresh and resumed, for the tiny and small models.

    python -m benchmarks.startup [--sizes tiny,small] [--rounds 3] [--quick]

Each run is a fresh `python -m nanotron.train` process (one rank, this machine's CPU) on the model of
`configs/<size>.toml` with a one-sample batch of 128 tokens, so the step itself is small next to start-up.
Time to first step = from starting the process to its first step line on stdout (imports, data mapping,
building and initialising the model, loading a checkpoint, the step itself). "fresh" draws the random init;
"resume" loads the checkpoint the fresh run saved and skips the init. `build_s` is the trainer's own
report of building the model (with the init when fresh). Rounds alternate fresh and resume; each row keeps
its best round. The CPU's normal-sample rate is measured too, to show what a per-rank CPU init of a large
model would cost.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import DEFAULT_WORK_DIR, REPO, RESULTS_DIR, bench_env, bench_parser, ensure_data, write_table

COLUMNS = ("size", "params_m", "start", "first_step_s", "build_s", "every_round_s")
BUILD = re.compile(r"built (?:and randomly initialised )?in ([\d.]+)s")


def run_to_first_step(args: list[str]) -> tuple[float, float]:
    """(seconds from launch to the first step line, the trainer's model build seconds)."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "nanotron.train", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=bench_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step, build, lines = None, None, []
    for line in proc.stdout:
        lines.append(line)
        match = BUILD.search(line)
        if match:
            build = float(match.group(1))
        if re.match(r"^(\S+ \S+ )?step ", line) and first_step is None:  # after the console's time of day
            first_step = time.perf_counter() - started
    proc.wait(timeout=600)
    if proc.returncode != 0 or first_step is None or build is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{''.join(lines[-40:])}")
    return first_step, build


def normal_samples_per_second() -> float:
    """How fast one CPU core draws the normal samples a random init needs."""
    import torch

    torch.set_num_threads(1)
    values, generator = torch.empty(2**25), torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        values.normal_(0.0, 0.02, generator=generator)
        best = min(best, time.perf_counter() - started)
    return values.numel() / best


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("startup", __doc__)
    parser.add_argument("--sizes", default="tiny,small", help="configs/<size>.toml models, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of fresh + resume per size (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny only, one round")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for startup.csv/.md")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="synthetic data and run dirs")
    args = parser.parse_args(argv)
    sizes, rounds = (["tiny"], 1) if args.quick else (args.sizes.split(","), args.rounds)
    data = ensure_data(args.work_dir)
    from nanotron.config import load_config
    from nanotron.models.shapes import num_params

    rows = []
    for size in sizes:
        config = REPO / "configs" / f"{size}.toml"
        params = num_params(load_config(str(config), []).model)
        times: dict[str, list[tuple[float, float]]] = {"fresh": [], "resume": []}
        for _ in range(rounds):
            run_dir = args.work_dir / "runs" / f"startup-{size}"
            shutil.rmtree(run_dir, ignore_errors=True)
            common = [
                "--config",
                str(config),
                *data,
                f"--job.out_dir={run_dir.parent}",
                f"--job.name={run_dir.name}",
                "--parallelism.dp=1",
                "--parallelism.tp=1",
                "--parallelism.pp=1",
                "--training.micro_batch_size=1",
                "--training.global_batch_size=1",
                "--training.seq_len=128",
                "--training.eval_interval=0",
                "--training.device=cpu",
                "--logging.tensorboard=false",
                "--logging.log_interval=1",
                "--logging.peak_tflops=1",
                "--checkpoint.interval=0",
                "--checkpoint.save_final=true",
            ]
            times["fresh"].append(run_to_first_step([*common, "--training.steps=1", "--checkpoint.resume_from=none"]))
            times["resume"].append(run_to_first_step([*common, "--training.steps=2", "--checkpoint.resume_from=auto"]))
        for start, measured in times.items():
            best = min(measured)
            rows.append(
                {
                    "size": size,
                    "params_m": params / 1e6,
                    "start": start,
                    "first_step_s": best[0],
                    "build_s": best[1],
                    "every_round_s": " ".join(f"{t:.2f}" for t, _ in measured),
                }
            )
            print(f"  {size:6s} {start:6s} first step {best[0]:6.2f}s (model build {best[1]:.2f}s)", flush=True)
    rate = normal_samples_per_second()
    print(write_table(rows, COLUMNS, args.out / "startup"))
    print(
        f"CPU init rate: {rate / 1e6:.0f} M normal samples/s per core -> drawing every full tensor of a 6.7B model "
        f"takes {6.7e9 / rate:.0f}s per rank, of a 70B model {70e9 / rate / 60:.1f} min per rank"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
