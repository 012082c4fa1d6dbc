"""Float8's cost in quality: the same model trained in bf16 and with float8 (torchao, tensorwise and rowwise), over
several seeds, compared on the final validation loss.

    python -m benchmarks.float8_quality [--size nano] [--steps 100] [--seeds 1 2 3] [--recipes off tensorwise]
        [--dtype bfloat16] [--global_batch_size 16]

Each run is one process of `configs/tiny.toml` at the benchmark model `--size` on the synthetic corpus, bf16
compute (FSDP mixed precision, fp32 master weights; `--dtype float32` for a CPU whose bf16 matmuls are too slow:
the reference is then fp32 compute, and float8's unconverted parts run in fp32), a constant LR after a short
warm-up. The seed changes the
initial weights and the sample order; each seed's float8 runs are compared with its bf16 run (paired), so the
seed-to-seed spread does not hide the float8 gap. On CPU float8 is emulated (same numerics as a GPU's float8
matmuls, slower than bf16): the losses are the measurement, not the speed (benchmarks/gpu_check.py times float8).
Writes float8_quality.csv/.md to --out, with the stability guard's statistics of each run (the largest loss and
gradient-norm z-scores after its warm-up, against its thresholds 6 and 8, the steps over any threshold: the
runs set stability.action=warn, so a spike is counted, not acted on; and its running statistics at the end,
`guard_at_end`) and float8_quality.png: the
training loss curves (mean over seeds) and each seed's float8 - bf16 loss gap along the run.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    REPO,
    RESULTS_DIR,
    bench_parser,
    ensure_data,
    model_overrides,
    run_nanotron,
    write_table,
)
from nanotron.config.resilience import StabilityConfig
from nanotron.stability import SIGNALS, SpikeDetector

RECIPES = ("off", "tensorwise", "rowwise")
COLUMNS = (
    "recipe",
    "seed",
    "final_eval_loss",
    "last10_train_loss",
    "gap_vs_bf16",
    "max_loss_z",
    "max_grad_norm_z",
    "max_grad_norm",
    "spikes",
    "guard_loss_mean",
    "guard_loss_std",
    "guard_grad_norm_mean",
    "guard_grad_norm_std",
    "step_time_sec",
)


def train(recipe: str, seed: int, settings, data: list[str]) -> dict:
    name = f"float8_quality-{recipe}-{seed}"
    args = [
        "--config",
        str(REPO / "configs" / "tiny.toml"),
        *model_overrides(settings.size),
        *data,
        f"--job.seed={seed}",
        f"--training.steps={settings.steps}",
        f"--training.dtype={settings.dtype}",
        f"--training.float8={recipe}",
        f"--training.micro_batch_size={min(8, settings.global_batch_size)}",
        f"--training.global_batch_size={settings.global_batch_size}",
        f"--training.eval_interval={settings.steps}",
        "--training.eval_steps=8",
        "--logging.log_interval=1",
        "--logging.tensorboard=false",
        "--checkpoint.save_final=false",
        "--checkpoint.resume_from=none",
        "--optimizer.warmup_steps=10",
        "--optimizer.decay_style=constant",
        "--watch.enabled=false",
        # The guard watches and logs but changes nothing (a spike would stop a run that keeps no checkpoint): the
        # curves are the recipes' own, and its statistics and spike count are the measurement.
        "--stability.action=warn",
        "--stability.replay=false",
    ]
    records = run_nanotron(name, args, 1, settings.work_dir, settings.steps)
    losses = [r["loss"] for r in records if "loss" in r]
    metrics = (settings.work_dir / "runs" / name / "metrics.jsonl").read_text().splitlines()
    evals = [line for line in metrics if '"eval_loss"' in line]
    eval_loss = json.loads(evals[-1])["eval_loss"]
    steps = [r for r in records if "loss" in r]
    guard = StabilityConfig()
    judged = steps[guard.warmup_steps :] or steps  # what the guard decides on: after its warm-up
    return {
        "recipe": recipe,
        "seed": seed,
        "final_eval_loss": round(eval_loss, 4),
        "last10_train_loss": round(statistics.mean(losses[-10:]), 4),
        "max_loss_z": round(max(r.get("stability/loss_z", 0.0) for r in judged), 2),
        "max_grad_norm_z": round(max(r.get("stability/grad_norm_z", 0.0) for r in judged), 2),
        "max_grad_norm": round(max(r["grad_norm"] for r in steps), 3),
        "spikes": sum(is_spike(r, guard) for r in judged),
        **guard_at_end(steps, guard),
        "step_time_sec": round(statistics.median(r["step_time_sec"] for r in records[2:]), 3),
        "losses": losses,
    }


def guard_at_end(steps: list[dict], guard: StabilityConfig) -> dict:
    """What the guard's running statistics read after the last step: its exponentially weighted mean of the log loss
    and log gradient norm (shown as the geometric mean, exp(mean)) and the standard deviation of its one-step
    forecast errors (sqrt(var), in log space: 0.01 is 1 %). Recomputed from the logged per-step values, which is
    what the guard saw: in warn mode every step, spikes included, joins its statistics."""
    detector = SpikeDetector(guard)
    for r in steps:
        detector.observe(r["loss"], r["grad_norm"])
    out = {}
    for name in SIGNALS:
        stats = detector.stats[name]
        out[f"guard_{name}_mean"] = round(math.exp(stats.mean), 4)
        out[f"guard_{name}_std"] = round(math.sqrt(stats.var), 4)
    return out


def is_spike(record: dict, guard: StabilityConfig) -> bool:
    """A step over any of the guard's default thresholds (what it would have replayed and rolled back)."""
    return (
        record.get("stability/loss_z", 0.0) > guard.loss_z
        or record.get("stability/grad_norm_z", 0.0) > guard.grad_norm_z
        or record.get("stability/loss_ratio", 0.0) > guard.loss_ratio
        or record.get("stability/grad_norm_ratio", 0.0) > guard.grad_norm_ratio
    )


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("float8_quality", __doc__)
    parser.add_argument("--size", default="nano", choices=("nano", "tiny", "small"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global_batch_size", type=int, default=16, help="sequences per step (micro batches of 8)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="compute dtype of the reference and of float8's unconverted parts (float32: a CPU without bf16 "
        "matmuls; the CSV's gap_vs_bf16 is then the gap to fp32)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES, help="'off' (bf16) first")
    parser.add_argument("--work_dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    settings = parser.parse_args(argv)
    data = ensure_data(settings.work_dir)
    rows = []
    recipes = ["off", *(r for r in settings.recipes if r != "off")]
    for seed in settings.seeds:
        bf16 = None
        for recipe in recipes:
            row = train(recipe, seed, settings, data)
            bf16 = row["final_eval_loss"] if recipe == "off" else bf16
            row["gap_vs_bf16"] = round(row["final_eval_loss"] - bf16, 4)
            rows.append(row)
            print({k: v for k, v in row.items() if k != "losses"}, flush=True)
            write_runs(rows, settings.out)  # each finished run kept: a sweep cut short still reports its runs
    for recipe in recipes[1:]:
        gaps = [r["gap_vs_bf16"] for r in rows if r["recipe"] == recipe]
        spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        print(
            f"{recipe}: final eval loss - bf16's = {statistics.mean(gaps):+.4f} (std {spread:.4f}, {len(gaps)} seeds)"
        )
    print(write_runs(rows, settings.out))
    plot(rows, settings.out / "float8_quality.png", settings.size, REFERENCE[settings.dtype])


def write_runs(rows: list[dict], out: Path) -> str:
    """float8_quality.csv/.md, and each run's per-step training losses (float8_quality_losses.json, the plot's data)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "float8_quality_losses.json").write_text(
        json.dumps([{k: r[k] for k in ("recipe", "seed", "losses")} for r in rows])
    )
    return write_table(rows, COLUMNS, out / "float8_quality")


def rolling(values: list[float], window: int = 10) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


REFERENCE = {"bfloat16": "bf16", "float32": "fp32"}  # what recipe 'off' is called in the figure


def plot(rows: list[dict], path: Path, size: str, reference: str = "bf16") -> None:
    """Left: training loss (10-step rolling mean, averaged over seeds) per recipe; right: each seed's float8 - bf16
    training-loss gap along the run (10-step rolling mean of the per-step difference)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return
    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(11, 4))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    for recipe in recipes:
        runs = [r["losses"] for r in rows if r["recipe"] == recipe]
        mean = [statistics.mean(step) for step in zip(*runs)]
        curves.plot(range(1, len(mean) + 1), rolling(mean), label=reference if recipe == "off" else recipe)
    bf16 = {r["seed"]: r["losses"] for r in rows if r["recipe"] == "off"}
    for r in rows:
        if r["recipe"] != "off":
            diff = [a - b for a, b in zip(r["losses"], bf16[r["seed"]])]
            gaps.plot(range(1, len(diff) + 1), rolling(diff), label=f"{r['recipe']} seed {r['seed']}", linewidth=0.9)
    gaps.axhline(0.0, color="gray", linewidth=0.8, linestyle="--")
    curves.set(xlabel="step", ylabel="training loss (10-step mean)", title=f"{size}: mean over seeds")
    gaps.set(xlabel="step", ylabel=f"float8 - {reference} training loss", title="paired by seed (10-step mean)")
    curves.legend()
    gaps.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
