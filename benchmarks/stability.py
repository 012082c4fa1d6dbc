"""Loss-spike handling measured: false alarms on a clean run, the spikes of a resume at a higher learning rate, the
margin between the two for every rule, and what detection costs a normal step.

    python -m benchmarks.stability [--steps 500] [--resume-step 100] [--lr-factors 10,30] [--rounds 3] [--quick]

Clean: `configs/tiny.toml` on the demo corpus (`make data`) for `--steps` steps with the default `[stability]`
settings (rollback on a spike): the spikes detected (stability records in metrics.jsonl) and, for each rule (the
z-scores of the loss and of the gradient norm, their ratios to their running means), the largest score after
warm-up (the detector's own record, saved in the final checkpoint) and how far it stays below its threshold.

Spikes: the clean run resumed from its checkpoint at `--resume-step` with the whole learning-rate schedule
(`optimizer.lr`, `optimizer.min_lr`) multiplied by each of `--lr-factors` (issue 42's case is 30x), for 10 steps,
with `stability.action=stop` (no replay): the step the guard stopped at, the rules that fired, and each score at
that step against its threshold (x1.00 or more is a detection).

Cost: the same run's model on the benchmark's synthetic corpus, `stability.enabled` true and false, rounds
interleaved (the 2 shared cores are noisy): the median step time of each and their ratio. The detector's host work
(scoring and observing one step) is also timed alone, over many calls, as a share of the measured step: the one
all-reduce a step already does carries its two numbers, so nothing else is added.

`--quick` (tests): 60 steps of the synthetic corpus instead of the demo run, resumed at step 40; the cost on the
nano model, one round.
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
    launch_nanotron,
    median_after_warmup,
    model_overrides,
    run_nanotron,
    write_table,
)
from nanotron.config import Config, StabilityConfig, load_config
from nanotron.stability import RULES, SIGNALS, SpikeDetector

CONFIG = str(REPO / "configs" / "tiny.toml")
COLUMNS = ("measure", "setup", "value", "detail")
SPIKE_STEPS = 10  # a spike must be detected within this many steps of the resume (issue 42, item 8)


def clean_args(steps: int, resume_step: int, work_dir: Path, quick: bool) -> tuple[list[str], str]:
    """The clean run's flags (a checkpoint every `resume_step` steps, all kept) and its description."""
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
        f"--checkpoint.interval={resume_step}",
        "--checkpoint.keep_last=0",
        "--checkpoint.save_final=true",
        "--checkpoint.resume_from=none",
        "--logging.log_interval=10",
        "--logging.tensorboard=false",
    ]
    return args, setup


def clean_run(args: list[str], setup: str, steps: int, work_dir: Path) -> list[dict]:
    """Spikes detected, and each rule's largest score after warm-up against its threshold, over a clean run."""
    run_dir = work_dir / "runs" / "clean"
    run_nanotron("clean", args, 1, work_dir, steps // 10)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    detections = [r for r in records if "stability/action" in r]
    state = json.loads((run_dir / "checkpoints" / f"step-{steps}" / "trainer_state.json").read_text())
    detector = state["stability"]["detector"]
    worst = {f"{name}_{kind}": detector[f"max_{kind}"][name] for kind in ("z", "ratio") for name in SIGNALS}
    thresholds = run_config(args).stability
    rows = [{"measure": "detections", "setup": setup, "value": len(detections), "detail": "target 0"}]
    for rule in RULES:
        limit = getattr(thresholds, rule)
        rows.append(
            {
                "measure": f"clean: largest {rule}",
                "setup": setup,
                "value": worst[rule],
                "detail": f"threshold {rule}={limit:g}: {margin(limit, worst[rule])} below it",
            }
        )
    return rows


def spike_run(args: list[str], factor: float, resume_step: int, steps: int, work_dir: Path) -> list[dict]:
    """The clean run resumed at `resume_step` with its learning-rate schedule `factor` times higher, stopped at the
    first spike: where, by which rules, and each score there against its threshold."""
    cfg = run_config(args)
    o, name = cfg.optimizer, f"lr{factor:g}x"
    resume = work_dir / "runs" / "clean" / "checkpoints" / f"step-{resume_step}"
    spiked = [
        *args,
        f"--optimizer.lr={o.lr * factor}",
        f"--optimizer.min_lr={o.min_lr * factor}",
        f"--optimizer.decay_steps={o.decay_steps or steps - o.warmup_steps}",  # the clean run's schedule, x factor
        f"--training.steps={resume_step + SPIKE_STEPS}",
        f"--checkpoint.resume_from={resume}",
        "--checkpoint.save_final=false",
        "--logging.log_interval=1",
        "--stability.action=stop",
        "--stability.replay=false",
    ]
    proc, run_dir = launch_nanotron(name, spiked, 1, work_dir)
    stdout, stderr = proc.communicate(timeout=900)
    if proc.returncode not in (0, 3, 4):  # 4: the guard stopped it; 3: a non-finite step stopped it first
        raise RuntimeError(f"{name} exited {proc.returncode}: {' '.join(proc.args)}\n{stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if "stability/action" in r]
    setup = f"resumed at step {resume_step} with lr and min_lr x{factor:g}, stability.action=stop"
    if not events:
        last = max((r["step"] for r in records if "step_time_sec" in r), default=resume_step)
        why = "non-finite loss or gradients" if proc.returncode == 3 else f"{last - resume_step} steps"
        detail = f"no spike detected (the run ended after {why})"
        return [{"measure": f"lr x{factor:g}: detected at step", "setup": setup, "value": "none", "detail": detail}]
    event = events[0]
    fired = ", ".join(event["stability/rules"])
    rows = [
        {
            "measure": f"lr x{factor:g}: detected at step",
            "setup": setup,
            "value": event["step"],
            "detail": f"{event['step'] - resume_step} steps after the resume, by {fired} (loss "
            f"{event['stability/loss']:.3g}, grad_norm {event['stability/grad_norm']:.3g})",
        }
    ]
    for rule in RULES:
        limit, score = getattr(cfg.stability, rule), event[f"stability/{rule}"]
        rows.append(
            {
                "measure": f"lr x{factor:g}: {rule} at detection",
                "setup": setup,
                "value": score,
                "detail": f"threshold {rule}={limit:g}: {margin(score, limit)} "
                + ("above it (fired)" if rule in event["stability/rules"] else "of it (did not fire)"),
            }
        )
    return rows


def margin(high: float, low: float) -> str:
    """How many times `low` fits in `high`, as x1.23 (ratios and z-scores alike: both are compared as they are)."""
    return f"x{high / low:.2f}" if low > 0 else "unbounded"


def run_config(args: list[str]) -> Config:
    """The config a run with these `--section.key=value` flags (and `--config FILE`) trains with."""
    flags = [a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a]
    return load_config(CONFIG if "--config" in args else None, [(key, value) for key, value in flags])


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
    parser.add_argument("--resume-step", type=int, default=100, help="the clean run's step the spikes resume from")
    parser.add_argument("--lr-factors", default="10,30", help="learning-rate multipliers of the spike runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args()
    steps, resume_step, rounds = (60, 40, 1) if args.quick else (args.steps, args.resume_step, args.rounds)
    factors = [float(f) for f in ("30" if args.quick else args.lr_factors).split(",")]
    if not 0 < resume_step <= steps - SPIKE_STEPS:
        parser.error(f"--resume-step: expected a step in 1..{steps - SPIKE_STEPS} (--steps={steps})")
    run_args, setup = clean_args(steps, resume_step, args.work_dir, args.quick)
    rows = clean_run(run_args, setup, steps, args.work_dir)
    for factor in factors:
        rows += spike_run(run_args, factor, resume_step, steps, args.work_dir)
    rows += cost(20, rounds, args.work_dir, "nano") if args.quick else cost(60, rounds, args.work_dir, "tiny")
    args.out.mkdir(parents=True, exist_ok=True)
    print(write_table(rows, COLUMNS, args.out / "stability"))


if __name__ == "__main__":
    main()
