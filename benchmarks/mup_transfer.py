"""µTransfer: does the best learning rate of a small model stay best as it grows? Standard parametrization vs µP.

    python -m benchmarks.mup_transfer [--widths 32,64,128,256] [--depths 4,16] [--lrs=-11,-3] [--steps 200]
                                      [--wider-steps 600] [--seeds 3] [--workers 2] [--quick]

For each parametrization, a learning-rate sweep (a log2 grid) trains every width at the first depth and every
depth at the first width of a model family (heads of 16 dims, so the head count grows with the width;
intermediate 4x). The base model is (first width, first depth), where µP equals standard parametrization.
Each run is short, on the Shakespeare corpus of `make data` (synthetic text with --quick): batch 16 x 64
tokens, warmup 10% of the steps, cosine decay to lr/10, AdamW. Its loss is the mean training loss of the last
20% of the steps: less than one pass over the data, so every batch is new to the model (held out) and the
estimate covers ~40k tokens. The best LR of a size is the vertex of a parabola fitted to its curve's lowest
points (the grid argmin is noisier; both are reported). Standard parametrization keeps init std 0.02 and one
LR for every parameter at every size; µP scales them (README, µP). The loss-vs-width curve at the base
model's best LR averages --seeds seeds (one run's noise, mostly early loss spikes, is as large as the gain of
a width doubling at these sizes). Runs go to --workers processes (one core each). Writes lr-transfer.png
(loss vs LR, a curve per width and one per depth, standard vs µP), wider-is-better.png (loss vs width at the
base model's best LR), mup_transfer.csv (every run) and mup_transfer.md (best LR per size, loss vs width at
the base's best LR, the targets) to --out.

The loss-vs-width curve has its own, longer horizon (--wider-steps): in --steps = 200 steps of these sizes
every width reaches the same loss under µP (the wide models learn more slowly at first and overtake the
narrow ones after ~300 steps). For it the base model's LR grid is run again at --wider-steps, and every width
trains at the best LR of that sweep (µP over --seeds seeds; standard parametrization over one).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy

from benchmarks.common import DEFAULT_WORK_DIR, RESULTS_DIR, markdown_table, write_csv
from benchmarks.inprocess import corpus_overrides, family_overrides, late_train_loss, train_run

PARAMETRIZATIONS = ("standard", "mup")
LABEL = {"standard": "standard", "mup": "µP"}


def run_point(point: tuple[str, int, int, int, int, int], common: list[str], args: argparse.Namespace) -> dict:
    """One (parametrization, width, depth, log2 lr, seed, steps) run, in this process; its row."""
    parametrization, width, depth, log2_lr, seed, steps = point
    lr = 2.0**log2_lr
    mup = [
        "--model.parametrization=mup",
        f"--model.mup_base_width={args.widths[0]}",
        f"--model.mup_base_depth={args.depths[0]}",
        f"--model.mup_base_head_dim={args.head_dim}",
    ]
    overrides = [
        *common,
        *family_overrides(width, depth, heads=max(width // args.head_dim, 1)),
        *(mup if parametrization == "mup" else []),
        f"--optimizer.lr={lr}",
        f"--optimizer.min_lr={lr / 10}",
        f"--job.seed={seed}",
        f"--training.steps={steps}",
        f"--optimizer.warmup_steps={max(steps // 10, 1)}",
    ]
    started = time.perf_counter()
    name = f"transfer-{parametrization}-w{width}-d{depth}-lr{log2_lr}-s{seed}-n{steps}"
    records, finished = train_run(name, overrides, args.work_dir)
    loss = late_train_loss(records, finished)
    return dict(parametrization=parametrization, width=width, depth=depth, log2_lr=log2_lr, lr=lr, seed=seed,
                steps=steps, loss=loss, seconds=time.perf_counter() - started)  # fmt: skip


def run_all(points: list[tuple], common: list[str], args: argparse.Namespace) -> list[dict]:
    """Every point on `args.workers` processes, costliest first."""
    points = sorted(points, key=lambda p: -(p[1] ** 2) * p[2] * p[5])
    if args.workers == 1:
        return [run_point(point, common, args) for point in points]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        return list(pool.map(run_point, points, [common] * len(points), [args] * len(points)))


def curve(rows: list[dict], parametrization: str, width: int, depth: int, steps: int) -> list[tuple[int, float]]:
    """(log2 lr, loss) of one model size in the sweep of `steps`-step runs (seed 0), diverged runs left out."""
    key = (parametrization, width, depth, 0, steps)
    points = [(r["log2_lr"], r["loss"]) for r in rows if (r["parametrization"], r["width"], r["depth"], r["seed"],
              r["steps"]) == key]  # fmt: skip
    return sorted((x, y) for x, y in points if math.isfinite(y))


def best_log2_lr(points: list[tuple[int, float]]) -> tuple[float, int]:
    """(fitted, grid) best log2 LR: the vertex of a least-squares parabola through the points within 0.25 nats of
    the lowest (at least it and its neighbours), which is steadier than the noisy grid argmin; the argmin itself
    where the fit is not a minimum inside the grid."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    i = ys.index(min(ys))
    chosen = [j for j, y in enumerate(ys) if y <= ys[i] + 0.25]
    if len(chosen) < 3:
        chosen = list(range(max(i - 1, 0), min(i + 2, len(xs))))
    if len(chosen) >= 3:
        a, b, _ = numpy.polyfit([xs[j] for j in chosen], [ys[j] for j in chosen], 2)
        if a > 0 and xs[0] <= -b / (2 * a) <= xs[-1]:
            return -b / (2 * a), xs[i]
    return float(xs[i]), xs[i]


def analyse(rows: list[dict], args, width_depth: int) -> tuple[list[dict], list[str]]:
    """The best LR per size and parametrization, and the transfer targets as sentences."""
    table, lines = [], []
    sweeps = (("width", [(w, width_depth) for w in args.widths]), ("depth", [(args.widths[0], d) for d in args.depths]))
    for sweep, sizes in sweeps:
        fitted: dict[str, list[float]] = {p: [] for p in PARAMETRIZATIONS}
        for width, depth in sizes:
            row = {"sweep": sweep, "size": width if sweep == "width" else depth}
            for p in PARAMETRIZATIONS:
                points = curve(rows, p, width, depth, args.steps)
                fit, grid = best_log2_lr(points)
                fitted[p].append(fit)
                row[f"{LABEL[p]} best log2 lr (fit; grid)"] = f"{fit:.2f}; {grid}"
                row[f"{LABEL[p]} loss"] = min(y for _, y in points)
            table.append(row)
        first, last = sizes[0][0 if sweep == "width" else 1], sizes[-1][0 if sweep == "width" else 1]
        for p in PARAMETRIZATIONS:
            shift = fitted[p][-1] - fitted[p][0]
            verdict = f" (target |shift| <= 1: {'met' if abs(shift) <= 1 else 'MISSED'})" if p == "mup" else ""
            lines.append(
                f"{LABEL[p]}: best lr at {sweep} {first} is 2^{fitted[p][0]:.2f}, at {sweep} {last} ({last // first}x) "
                f"2^{fitted[p][-1]:.2f}: moved {shift:+.2f} grid steps{verdict}"
            )
    return table, lines


def base_best_log2_lr(rows: list[dict], args, width_depth: int, steps: int) -> tuple[float, int]:
    """(fitted, grid) best log2 LR of the base model at `steps` steps (µP is standard there: one curve)."""
    return best_log2_lr(curve(rows, "mup", args.widths[0], width_depth, steps))


def width_losses(rows: list[dict], args, parametrization: str, depth: int, log2_lr: int, steps: int) -> dict:
    """Every seed's loss per width at one LR and horizon (standard parametrization: seed 0 only). At the base
    width both parametrizations are one model, whose runs are µP's (the wider stage runs it only as µP)."""
    losses: dict[int, list[float]] = {}
    for r in rows:
        owner = "mup" if r["width"] == args.widths[0] else parametrization
        if (r["parametrization"], r["depth"], r["log2_lr"], r["steps"]) == (owner, depth, log2_lr, steps):
            if parametrization == "mup" or r["seed"] == 0:
                losses.setdefault(r["width"], []).append(r["loss"])
    return losses


def wider_is_better(rows: list[dict], args, width_depth: int, log2_lr: int, steps: int, target: bool) -> list[str]:
    lines = []
    for p in ("mup", "standard"):
        losses = width_losses(rows, args, p, width_depth, log2_lr, steps)
        means = [statistics.fmean(losses[w]) for w in args.widths]
        monotone = all(b < a for a, b in zip(means, means[1:]))
        verdict = f" (target: {'met' if monotone else 'MISSED'})" if p == "mup" and target else ""
        per_seed = "; ".join(f"{w}: " + " ".join(f"{x:.3f}" for x in losses[w]) for w in args.widths)
        count = len(losses[args.widths[0]])
        lines.append(
            f"{LABEL[p]}: {steps} steps at the base's best lr 2^{log2_lr}, mean loss over {count} seed(s) by width "
            f"{args.widths}: " + ", ".join(f"{x:.4f}" for x in means)
            + (" (decreasing with width)" if monotone else " (NOT decreasing with width)")
            + f"{verdict}; per seed {per_seed}"
        )  # fmt: skip
    return lines


def plot(rows: list[dict], args, width_depth: int, log2_lr: int) -> bool:
    """lr-transfer.png (the --steps sweeps) and wider-is-better.png (the --wider-steps stage at `log2_lr`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    finite = [r["loss"] for r in rows if math.isfinite(r["loss"])]
    low, high = min(finite) - 0.05, min(max(finite), min(finite) + 2.0)
    sweeps = (("width", [(w, width_depth) for w in args.widths]), ("depth", [(args.widths[0], d) for d in args.depths]))
    fig, axes = plt.subplots(len(sweeps), 2, figsize=(11, 4.2 * len(sweeps)), sharey=True, squeeze=False)
    colors = plt.get_cmap("viridis")
    for i, (sweep, sizes) in enumerate(sweeps):
        for j, p in enumerate(PARAMETRIZATIONS):
            ax = axes[i][j]
            for k, (width, depth) in enumerate(sizes):
                points = curve(rows, p, width, depth, args.steps)
                color = colors(k / max(len(sizes) - 1, 1))
                label = f"width {width}" if sweep == "width" else f"depth {depth}"
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", color=color, label=label)
                fit, _ = best_log2_lr(points)
                ax.axvline(fit, color=color, linestyle=":", linewidth=1)
            ax.set_ylim(low, high)
            ax.set_xlabel("log2 learning rate")
            ax.set_title(f"{LABEL[p]}: loss vs LR across {sweep} (dotted: fitted best)", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[i][0].set_ylabel(f"train loss, last 20% of {args.steps} steps")
    fig.tight_layout()
    fig.savefig(args.out / "lr-transfer.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for p, marker in zip(PARAMETRIZATIONS, ("s", "o")):
        losses = width_losses(rows, args, p, width_depth, log2_lr, args.wider_steps)
        means = {w: statistics.fmean(losses[w]) for w in args.widths}
        xs = [w for w in args.widths if math.isfinite(means[w])]
        ax.plot(xs, [means[w] for w in xs], marker=marker, label=f"{LABEL[p]} at lr 2^{log2_lr} (base's best)")
        for w in xs:
            ax.plot(
                [w] * len(losses[w]), losses[w], marker=marker, linestyle="", alpha=0.3, color=ax.lines[-1].get_color()
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.widths, [str(w) for w in args.widths])
    ax.set_xlabel("width (hidden size)")
    ax.set_ylabel(f"train loss, last 20% of {args.wider_steps} steps")
    ax.set_title("Wider is better: loss vs width at the base model's best LR (mean, and each seed)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "wider-is-better.png", dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="32,64,128,256", help="width sweep; the first is µP's base width")
    parser.add_argument("--depths", default="4,16", help="depth sweep at the first width; the first is µP's base")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the loss-vs-width curve at the base's best LR")
    parser.add_argument("--lrs", default="-11,-3", help="log2 LR grid: first,last (every integer between)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run of the LR sweeps")
    parser.add_argument("--wider-steps", type=int, default=600, help="steps per run, loss vs width")
    parser.add_argument("--head-dim", type=int, default=16, help="head dim of every model (heads = width / it)")
    parser.add_argument("--workers", type=int, default=2, help="processes running the sweep's runs")
    parser.add_argument("--quick", action="store_true", help="2 widths, 2 depths, 3 LRs, 3 steps, synthetic text")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.depths, args.lrs, args.steps, args.workers, args.seeds = "32,64", "1,2", "-8,-6", 3, 1, 2
        args.wider_steps = 4
    args.widths = [int(w) for w in args.widths.split(",")]
    args.depths = [int(d) for d in args.depths.split(",")]
    first, last = (int(x) for x in args.lrs.split(","))
    grid = list(range(first, last + 1))
    args.shape = [
        "--model.vocab_size=1024",
        "--model.max_seq_len=64",
        "--training.seq_len=64",
        "--training.micro_batch_size=16",
        "--training.grad_accum_steps=1",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    common = [
        *corpus_overrides(args.work_dir, args.quick),
        *args.shape,
        "--training.eval_interval=0",
        "--logging.log_interval=1",
        "--optimizer.decay_style=cosine",
    ]
    width_depth = args.depths[0]
    sizes = [(w, width_depth) for w in args.widths] + [(args.widths[0], d) for d in args.depths[1:]]
    points = [(p, w, d, lr, 0, args.steps) for w, d in sizes for p in PARAMETRIZATIONS for lr in grid]
    started = time.perf_counter()
    # The first run alone, in this process: it tokenizes the corpus into the cache the workers then read.
    rows = [run_point(points[0], common, args)]
    rows += run_all(points[1:], common, args)
    for w, d in sizes:
        for p in PARAMETRIZATIONS:
            losses = " ".join(f"{y:.3f}" for _, y in curve(rows, p, w, d, args.steps))
            print(f"  {p:8s} width {w:4d} depth {d:2d}: loss by lr 2^{first}..2^{last}: {losses}", flush=True)
    table, lines = analyse(rows, args, width_depth)
    sweep_lr = round(base_best_log2_lr(rows, args, width_depth, args.steps)[0])
    lines += wider_is_better(rows, args, width_depth, sweep_lr, args.steps, target=False)
    # Wider is better, at its own horizon: the base's LR grid again, then every width at its best LR (µP over
    # --seeds seeds, since one run's noise is as large as a width doubling's gain; standard over one).
    base = [("mup", args.widths[0], width_depth, lr, 0, args.wider_steps) for lr in grid]
    rows += run_all(base, common, args)
    fit, grid_best = base_best_log2_lr(rows, args, width_depth, args.wider_steps)
    base_lr = round(fit)
    lines.append(
        f"base model at {args.wider_steps} steps: best lr 2^{fit:.2f} fitted (grid minimum 2^{grid_best}); every "
        f"width trains at the grid LR nearest the fit, 2^{base_lr}"
    )
    wider = [("mup", w, width_depth, base_lr, s, args.wider_steps) for w in args.widths for s in range(args.seeds)
             if (w, s) != (args.widths[0], 0)]  # fmt: skip  # the base's seed 0 ran in its grid
    wider += [("standard", w, width_depth, base_lr, 0, args.wider_steps) for w in args.widths[1:]]
    rows += run_all(wider, common, args)
    lines += wider_is_better(rows, args, width_depth, base_lr, args.wider_steps, target=True)
    rows.sort(key=lambda r: (r["steps"], r["seed"], r["depth"], r["width"], r["parametrization"], r["log2_lr"]))
    write_csv(rows, args.out / "mup_transfer.csv")
    markdown = markdown_table(table, list(table[0]))
    elapsed = time.perf_counter() - started
    (args.out / "mup_transfer.md").write_text(
        f"{len(rows)} runs: lr grid 2^{first}..2^{last} at {args.steps} steps, width sweep at depth {width_depth}, "
        f"depth sweep at width {args.widths[0]}; wider is better at {args.wider_steps} steps ({args.seeds} µP seeds "
        f"at the base's best lr); {elapsed / 60:.1f} min in all\n\n{markdown}\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    print(markdown + "\n" + "\n".join(lines))
    if not plot(rows, args, width_depth, base_lr):
        print("matplotlib missing (pip install -e '.[bench]'): no plot written")
    print(f"mup transfer: {len(rows)} runs in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
