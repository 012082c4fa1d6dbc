"""Loss-spike handling measured: false alarms on a clean run, and what detection costs a normal step.

    python -m benchmarks.stability [--steps 500] [--rounds 3] [--quick]

Clean: `configs/tiny.toml` on the demo corpus (`make data`) for `--steps` steps with the default `[stability]`
settings (rollback on a spike): the spikes detected (stability records in metrics.jsonl) and the largest z-score
of the loss and of the gradient norm after warm-up (the detector's own record, saved in the final checkpoint).

Cost: the same run's model on the benchmark's synthetic corpus, `stability.enabled` true and false, rounds
interleaved (the 2 shared cores are noisy): the median step time of each and their ratio. The detector's host work
(scoring and observing one step) is also timed alone, over many calls, as a share of the measured step: the one
all-reduce a step already does carries its two numbers, so nothing else is added.

`--quick` (tests): 60 steps of the synthetic corpus instead of the demo run; the cost on the nano model, one round.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    QUIET_RUN,
    REPO,
    RESULTS_DIR,
    bench_parser,
    ensure_data,
    median_after_warmup,
    model_overrides,
    run_nanotron,
    write_table,
)
from nanotron.config import StabilityConfig
from nanotron.stability import SpikeDetector

CONFIG = str(REPO / "configs" / "tiny.toml")
COLUMNS = ("measure", "setup", "value", "detail")


def clean_run(steps: int, work_dir: Path, quick: bool) -> list[dict]:
    """Spikes detected and the largest z-scores over a clean run with the default settings."""
    run_dir = work_dir / "runs" / "clean"
    if quick:
        args = [*ensure_data(work_dir), *model_overrides("nano"), "--stability.warmup_steps=20"]
        setup = f"nano, synthetic corpus, {steps} steps, warmup_steps=20"
    else:
        if not (REPO / "data" / "tokenized" / "shakespeare").is_dir():
            raise SystemExit("the demo corpus is missing: run `make data` first (or use --quick)")
        args = ["--config", CONFIG]
        setup = f"configs/tiny.toml, demo corpus, {steps} steps, default [stability]"
    args += [
        f"--training.steps={steps}",
        "--checkpoint.interval=100",
        "--checkpoint.save_final=true",
        "--checkpoint.resume_from=none",
        "--logging.log_interval=10",
        "--logging.tensorboard=false",
    ]
    run_nanotron("clean", args, 1, work_dir, steps // 10)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    detections = [r for r in records if "stability/action" in r]
    state = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "trainer_state.json").read_text())
    max_z = state["stability"]["detector"]["max_z"]
    return [
        {"measure": "detections", "setup": setup, "value": len(detections), "detail": "target 0"},
        {"measure": "max loss z", "setup": setup, "value": max_z["loss"], "detail": "threshold loss_z=6"},
        {"measure": "max grad_norm z", "setup": setup, "value": max_z["grad_norm"], "detail": "threshold 8"},
    ]


def cost(steps: int, rounds: int, work_dir: Path, size: str) -> list[dict]:
    """Median step time with detection on and off, interleaved; and the detector's host time per step."""
    base = [*QUIET_RUN, *ensure_data(work_dir), *model_overrides(size), f"--training.steps={steps}"]
    times: dict[bool, list[float]] = {True: [], False: []}
    for index in range(rounds):
        for enabled in (True, False) if index % 2 == 0 else (False, True):
            records = run_nanotron("cost", [*base, f"--stability.enabled={enabled}"], 1, work_dir, steps)
            times[enabled].append(median_after_warmup([r["step_time_sec"] for r in records], 5))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    detector, calls = SpikeDetector(StabilityConfig(warmup_steps=10)), 100_000
    started = time.perf_counter()
    for i in range(calls):
        detector.is_spike(detector.scores(3.0 + 0.01 * (i % 7), 1.0))
        detector.observe(3.0 + 0.01 * (i % 7), 1.0)
    host = (time.perf_counter() - started) / calls
    rounds_text = ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(times[True], times[False]))
    setup = f"{size} model, 1 process, {steps} steps x {rounds} rounds"
    return [
        {"measure": "step time on / off", "setup": setup, "value": on / off, "detail": f"round medians {rounds_text}"},
        {"measure": "detector host time / step", "setup": setup, "value": host / on, "detail": f"{host * 1e6:.1f} us"},
    ]


def main() -> None:
    parser = bench_parser("stability", __doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args()
    steps, rounds = (60, 1) if args.quick else (args.steps, args.rounds)
    rows = clean_run(steps, args.work_dir, args.quick)
    rows += cost(20, rounds, args.work_dir, "nano") if args.quick else cost(60, rounds, args.work_dir, "tiny")
    args.out.mkdir(parents=True, exist_ok=True)
    print(write_table(rows, COLUMNS, args.out / "stability"))


if __name__ == "__main__":
    main()
