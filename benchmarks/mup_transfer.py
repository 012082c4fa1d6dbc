"""µTransfer: does the best learning rate of a small model stay best as it grows? Standard parametrization vs µP.

    python -m benchmarks.mup_transfer [--widths 32,64,128,256] [--depths 4,16] [--lrs=-11,-3] [--steps 200]
                                      [--wider-steps 600] [--seeds 3] [--lr-seeds 3] [--kv-heads N]
                                      [--device cpu|cuda] [--preset cpu|gpu] [--workers 2] [--quick] [--resume]
    python -m benchmarks.mup_transfer --sweep-only --optimizer muon --parametrizations mup   # Muon's µP sweep
    python -m benchmarks.mup_transfer --replot [--sweep-only]       # the figures again from the CSV
    python -m benchmarks.mup_transfer --wider-only -6 --wider-steps 1000   # the loss-vs-width stage alone
    python -m benchmarks.mup_transfer --wider-only base --lrs=-9,-5 --wider-steps 1000 --tune-standard

For each parametrization, a learning-rate sweep (a log2 grid, --lr-seeds seeds per point) trains every width at
the first depth and every depth at the first width of a model family (heads of --head-dim dims, so the head
count grows with the width; intermediate 4x; --kv-heads N: N K/V heads at every width, a fixed K/V width, the
grouped-query case). The base model is (first width, first depth), where µP equals standard parametrization.
Each run is short, on the Shakespeare corpus of `make data` (synthetic text with --quick): batch 16 x 64
tokens, warmup 10% of the steps, cosine decay to lr/10, AdamW. Its loss is the mean training loss of the last
20% of the steps: less than one pass over the data, so every batch is new to the model (held out) and the
estimate covers ~40k tokens. The best LR of a size is the vertex of a parabola fitted to its seed-mean curve's
lowest points (the grid argmin is noisier; both are reported), with a 95% bootstrap interval (the seeds of
every LR resampled). Standard parametrization keeps init std 0.02 and one LR for every parameter at every size;
µP scales them (docs/mup.md). Runs go to --workers processes (one core each). Writes lr-transfer.png (loss vs LR,
a curve per width and one per depth, standard vs µP), wider-is-better.png (loss vs width), mup_transfer.csv
(every run) and mup_transfer.md (best LR per size with its interval, loss vs width, the targets) to --out.

The loss-vs-width curve has its own, longer horizon (--wider-steps): in --steps = 200 steps of these sizes
every width reaches the same loss under µP (the wide models learn more slowly at first and overtake the
narrow ones after ~300 steps). For it the base model's LR grid is run again at --wider-steps, and every width
trains at the best LR of that sweep (µP over --seeds seeds), against standard parametrization both at that LR
and tuned per width (its own sweep's best LR at each width and the grid steps either side, the best of those
over --seeds seeds). --wider-only LOG2_LR runs that stage alone at a given LR (--wider-only base: at the best
LR of the base's --lrs grid run first at --wider-steps, --lr-seeds seeds each); with --tune-standard, standard
is tuned per width there too, without a sweep: a bracketed LR search from the LR µP gives the width's hidden
matrices. --preset gpu: widths 128 -> 2048 (16x), heads of 64, 256-token sequences, on CUDA.
--optimizer muon: Muon for the layer matrices (µP's Muon LR rule, docs/mup.md; AdamW for the rest), the LR sweeps
only, into mup_transfer_sweep_muon.csv/.md and lr-transfer-sweep-muon.png; --parametrizations mup sweeps µP alone.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy
import torch

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    RESULTS_DIR,
    RunCache,
    bench_parser,
    markdown_table,
    source_digest,
    write_csv,
)
from benchmarks.inprocess import corpus_overrides, family_overrides, late_train_loss, train_run

PARAMETRIZATIONS = ("standard", "mup")
LABEL = {"standard": "standard", "mup": "µP"}


def point_overrides(point: tuple, common: list[str], args: argparse.Namespace) -> list[str]:
    """The `nanotron train` overrides of one (parametrization, width, depth, log2 lr, seed, steps) run."""
    parametrization, width, depth, log2_lr, seed, steps = point
    lr = 2.0**log2_lr
    base_width = args.widths[0]
    base_heads = max(base_width // args.head_dim, 1)
    mup = [
        "--model.parametrization=mup",
        f"--model.mup_base.hidden={base_width}",
        f"--model.mup_base.intermediate={4 * base_width}",
        f"--model.mup_base.heads={base_heads}",
        f"--model.mup_base.kv_heads={args.kv_heads or base_heads}",
        f"--model.mup_base.layers={args.depths[0]}",
    ]
    heads = max(width // args.head_dim, 1)
    return [
        *common,
        *family_overrides(width, depth, heads=heads, kv_heads=args.kv_heads or heads),
        *(mup if parametrization == "mup" else []),
        f"--optimizer.lr={lr}",
        f"--optimizer.min_lr={lr / 10}",
        f"--job.seed={seed}",
        f"--training.steps={steps}",
        f"--optimizer.warmup_steps={max(steps // 10, 1)}",
    ]


def run_point(point: tuple[str, int, int, int, int, int], common: list[str], args: argparse.Namespace) -> dict:
    """One (parametrization, width, depth, log2 lr, seed, steps) run, in this process; its row."""
    parametrization, width, depth, log2_lr, seed, steps = point
    started = time.perf_counter()
    name = f"transfer-{parametrization}-w{width}-d{depth}-lr{log2_lr}-s{seed}-n{steps}"
    records, finished = train_run(name, point_overrides(point, common, args), args.work_dir)
    loss = late_train_loss(records, finished)
    return dict(parametrization=parametrization, width=width, depth=depth, log2_lr=log2_lr, lr=2.0**log2_lr,
                seed=seed, steps=steps, loss=loss, seconds=time.perf_counter() - started)  # fmt: skip


def run_cache(common: list[str], args: argparse.Namespace) -> RunCache:
    """--resume: finished runs' rows in `<work dir>/mup_transfer_runs.jsonl`, each under a key of its overrides
    and the code's hash, so a sweep stopped part-way reruns only what is missing — and nothing measured by other
    code or with other settings is reused."""
    code = source_digest() if args.resume else ""

    def key(point: tuple) -> str:
        return hashlib.sha256(json.dumps([code, point_overrides(point, common, args)]).encode()).hexdigest()

    return RunCache(args.work_dir / "mup_transfer_runs.jsonl", args.resume, key)


def run_all(points: list[tuple], common: list[str], args: argparse.Namespace, workers: int | None = None) -> list[dict]:
    """Every point on `workers` (default --workers) processes, costliest first; with --resume, the points a
    previous invocation finished with the same code and settings are read back instead of run."""
    cache = run_cache(common, args)
    points = sorted(points, key=lambda p: -(p[1] ** 2) * p[2] * p[5])
    rows = {point: cache.get(point) for point in points}
    todo = [point for point, row in rows.items() if row is None]
    if len(todo) < len(points):
        print(f"  --resume: {len(points) - len(todo)} of {len(points)} runs read back from {cache.path}", flush=True)
    workers = workers or args.workers
    if workers == 1:
        for point in todo:
            rows[point] = run_point(point, common, args)
            cache.put(point, rows[point])
    elif todo:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            futures = {pool.submit(run_point, point, common, args): point for point in todo}
            for future in as_completed(futures):
                rows[futures[future]] = future.result()
                cache.put(futures[future], rows[futures[future]])
    return [rows[point] for point in points]


def seed_losses(rows: list[dict], parametrization: str, width: int, depth: int, steps: int) -> dict[int, list]:
    """log2 lr -> every seed's loss, of one model size in the sweep of `steps`-step runs."""
    by_lr: dict[int, list[float]] = {}
    for r in rows:
        if (r["parametrization"], r["width"], r["depth"], r["steps"]) == (parametrization, width, depth, steps):
            by_lr.setdefault(r["log2_lr"], []).append(r["loss"])
    return by_lr


def curve(rows: list[dict], parametrization: str, width: int, depth: int, steps: int) -> list[tuple[int, float]]:
    """(log2 lr, mean loss over seeds) of one model size; an LR where any seed diverged is left out."""
    by_lr = seed_losses(rows, parametrization, width, depth, steps)
    means = [(x, statistics.fmean(v)) for x, v in by_lr.items()]
    return sorted((x, y) for x, y in means if math.isfinite(y))


def best_lr_interval(by_lr: dict[int, list[float]], resamples: int = 1000) -> tuple[float, float] | None:
    """A 95% bootstrap interval of the fitted best log2 LR: the seeds of every LR resampled with replacement,
    the parabola refitted each time (percentiles 2.5 and 97.5); None with one seed per LR."""
    if min(len(v) for v in by_lr.values()) < 2:
        return None
    rng, fits = numpy.random.default_rng(0), []
    lrs = sorted(by_lr)
    for _ in range(resamples):
        means = [(x, float(numpy.mean(rng.choice(by_lr[x], len(by_lr[x]))))) for x in lrs]
        points = [(x, y) for x, y in means if math.isfinite(y)]
        if len(points) >= 2:
            fits.append(best_log2_lr(points)[0])
    low, high = numpy.percentile(fits, [2.5, 97.5])
    return float(low), float(high)


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
        fitted: dict[str, list[float]] = {p: [] for p in args.parametrizations}
        for width, depth in sizes:
            row = {"sweep": sweep, "size": width if sweep == "width" else depth}
            for p in args.parametrizations:
                points = curve(rows, p, width, depth, args.steps)
                fit, grid = best_log2_lr(points)
                fitted[p].append(fit)
                interval = best_lr_interval(seed_losses(rows, p, width, depth, args.steps))
                ci = f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""
                row[f"{LABEL[p]} best log2 lr (fit [95% CI]; grid)"] = f"{fit:.2f}{ci}; {grid}"
                row[f"{LABEL[p]} loss"] = min(y for _, y in points)
            table.append(row)
        first, last = sizes[0][0 if sweep == "width" else 1], sizes[-1][0 if sweep == "width" else 1]
        for p in args.parametrizations:
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


def tuned_standard(rows: list[dict], args, depth: int, base_lr: int, steps: int) -> tuple[dict, dict]:
    """Standard parametrization at each width's own best LR at this horizon (the lowest seed-0 loss among the
    LRs it ran): every seed's loss there, and the LR. The base width is µP's base model at its best LR."""
    losses, lrs = {}, {}
    for w in args.widths:
        if w == args.widths[0]:
            losses[w], lrs[w] = width_losses(rows, args, "mup", depth, base_lr, steps)[w], base_lr
            continue
        by_lr = seed_losses(rows, "standard", w, depth, steps)
        key = ("standard", w, depth, steps, 0)
        seed0 = {
            r["log2_lr"]: r["loss"]
            for r in rows
            if (r["parametrization"], r["width"], r["depth"], r["steps"], r["seed"]) == key
        }
        lrs[w] = min(seed0, key=lambda lr: seed0[lr] if math.isfinite(seed0[lr]) else math.inf)
        losses[w] = by_lr[lrs[w]]
    return losses, lrs


def bracket_standard(rows: list[dict], args, common: list[str], depth: int, base_lr: int, steps: int) -> list[dict]:
    """Standard parametrization tuned per width at this horizon without a sweep to start from: seed 0 at the LR
    µP gives the width's hidden matrices (base LR - log2(width / base)) and the grid steps either side, then one
    more step past whichever end is lowest until the lowest loss is inside the LRs run (a bracketed minimum, at
    most --bracket-rounds extensions), then --seeds - 1 more seeds at that LR. Widths search in parallel."""
    starts = {w: base_lr - round(math.log2(w / args.widths[0])) for w in args.widths[1:]}
    todo = [("standard", w, depth, start + d, 0, steps) for w, start in starts.items() for d in (-1, 0, 1)]
    for _ in range(args.bracket_rounds + 1):
        done = {point_of(r) for r in rows}
        rows = rows + run_all([point for point in todo if point not in done], common, args)
        todo = []
        lrs = tuned_standard(rows, args, depth, base_lr, steps)[1]
        for w in args.widths[1:]:
            tried = {r["log2_lr"] for r in rows if (r["parametrization"], r["width"], r["depth"], r["steps"],
                     r["seed"]) == ("standard", w, depth, steps, 0)}  # fmt: skip
            for edge, step in ((min(tried), -1), (max(tried), 1)):
                if lrs[w] == edge:
                    todo.append(("standard", w, depth, edge + step, 0, steps))
        if not todo:
            break
    else:
        print("  standard tuned per width: a minimum still at the edge of its LRs after --bracket-rounds", flush=True)
    lrs = tuned_standard(rows, args, depth, base_lr, steps)[1]
    extra = [("standard", w, depth, lrs[w], s, steps) for w in args.widths[1:] for s in range(1, args.seeds)]
    return rows + run_all(extra, common, args)


def tuned_lines(rows: list[dict], args, depth: int, base_lr: int, steps: int) -> list[str]:
    """Standard tuned per width against µP at the base's LR: the LRs, losses and gaps; each doubling's claim."""
    losses, lrs = tuned_standard(rows, args, depth, base_lr, steps)
    mup = width_losses(rows, args, "mup", depth, base_lr, steps)
    gaps = []
    for w in args.widths:
        gap = statistics.fmean(mup[w]) - statistics.fmean(losses[w])
        if min(len(mup[w]), len(losses[w])) > 1 and w != args.widths[0]:
            se = (statistics.variance(mup[w]) / len(mup[w]) + statistics.variance(losses[w]) / len(losses[w])) ** 0.5
            gaps.append(f"{w}: {gap:+.4f} ± {2 * se:.4f}")
        else:
            gaps.append(f"{w}: {gap:+.4f}")
    return [
        f"standard tuned per width ({steps} steps, its best LR per width "
        + ", ".join(f"{w}: 2^{lrs[w]}" for w in args.widths)
        + "): mean loss "
        + ", ".join(f"{statistics.fmean(losses[w]):.4f}" for w in args.widths)
        + f" over {len(losses[args.widths[-1]])} seed(s) per width; µP at the base's LR minus tuned standard "
        + f"(± 2 s.e.): {', '.join(gaps)}",
        f"standard tuned per doubling: {width_claim(losses, args.widths)}",
    ]


def wider_is_better(rows: list[dict], args, width_depth: int, log2_lr: int, steps: int, target: bool) -> list[str]:
    lines = []
    for p in sorted(args.parametrizations):  # µP's line first
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


def loss_axis(rows: list[dict], steps: int) -> tuple[float, float]:
    """The y-range of the LR sweeps' panels: their own runs' losses only (the longer wider-is-better runs reach
    lower losses and would squash every curve), from the lowest to at most 2 nats above it."""
    finite = [r["loss"] for r in rows if r["steps"] == steps and math.isfinite(r["loss"])]
    return min(finite) - 0.05, min(max(finite), min(finite) + 2.0) + 0.05


def width_claim(losses: dict[int, list[float]], widths: list[int]) -> str:
    """What the loss-vs-width data supports, doubling by doubling: a width is better than the one before when
    its mean loss is lower by more than twice the standard error of the difference (seeds), else a tie."""
    verdicts = []
    for a, b in zip(widths, widths[1:]):
        ma, mb = statistics.fmean(losses[a]), statistics.fmean(losses[b])
        var = sum(statistics.variance(x) / len(x) for x in (losses[a], losses[b]) if len(x) > 1)
        if len(losses[a]) < 2 or len(losses[b]) < 2:
            verdicts.append(f"{a}->{b}: {'lower' if mb < ma else 'higher'} (one seed: untested)")
        elif ma - mb > 2 * var**0.5:
            verdicts.append(f"{a}->{b}: better")
        elif mb - ma > 2 * var**0.5:
            verdicts.append(f"{a}->{b}: worse")
        else:
            verdicts.append(f"{a}->{b}: tie")
    return ", ".join(verdicts)


def plot(rows: list[dict], args, width_depth: int, log2_lr: int | None, name: str = "lr-transfer.png") -> bool:
    """lr-transfer.png (the --steps sweeps) and wider-is-better.png (the --wider-steps stage at `log2_lr`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    low, high = loss_axis(rows, args.steps)
    sweeps = (("width", [(w, width_depth) for w in args.widths]), ("depth", [(args.widths[0], d) for d in args.depths]))
    columns = len(args.parametrizations)
    fig, axes = plt.subplots(
        len(sweeps), columns, figsize=(5.5 * columns, 4.2 * len(sweeps)), sharey=True, squeeze=False
    )
    colors = plt.get_cmap("viridis")
    for i, (sweep, sizes) in enumerate(sweeps):
        for j, p in enumerate(args.parametrizations):
            ax = axes[i][j]
            for k, (width, depth) in enumerate(sizes):
                points = curve(rows, p, width, depth, args.steps)
                color = colors(k / max(len(sizes) - 1, 1))
                label = f"width {width}" if sweep == "width" else f"depth {depth}"
                by_lr = seed_losses(rows, p, width, depth, args.steps)
                errors = [
                    statistics.stdev(by_lr[x]) / len(by_lr[x]) ** 0.5 if len(by_lr[x]) > 1 else 0 for x, _ in points
                ]
                xs, ys = [x for x, _ in points], [y for _, y in points]
                ax.errorbar(xs, ys, yerr=errors, marker="o", color=color, label=label, capsize=2)
                fit, _ = best_log2_lr(points)
                ax.axvline(fit, color=color, linestyle=":", linewidth=1)
                interval = best_lr_interval(by_lr)
                if interval:  # the best LR's 95% bootstrap interval, a band at the panel's foot
                    ax.axvspan(*interval, ymin=0.0, ymax=0.04 + 0.03 * k, color=color, alpha=0.35, linewidth=0)
            ax.set_ylim(low, high)
            ax.set_xlabel("log2 learning rate")
            seeds = max(len(v) for w, d in sizes for v in seed_losses(rows, p, w, d, args.steps).values())
            ax.set_title(
                f"{LABEL[p]}{args.optimizer_label}: loss vs LR across {sweep}, mean ± s.e. of {seeds} seed(s)\n"
                "(dotted: fitted best LR; "
                "bands at the foot: its 95% bootstrap interval)",
                fontsize=9,
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[i][0].set_ylabel(f"train loss, last 20% of {args.steps} steps")
    fig.tight_layout()
    fig.savefig(args.out / name, dpi=100)
    plt.close(fig)
    if log2_lr is not None:
        plot_wider(rows, args, width_depth, log2_lr, args.out / "wider-is-better.png")
    return True


def plot_wider(rows: list[dict], args, width_depth: int, log2_lr: int, path: Path) -> None:
    """Loss vs width at one LR and the --wider-steps horizon: means with standard errors, every seed, and what
    each doubling's data supports (width_claim)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    claims = []
    for p, marker in zip(PARAMETRIZATIONS, ("s", "o")):
        losses = width_losses(rows, args, p, width_depth, log2_lr, args.wider_steps)
        means = {w: statistics.fmean(losses[w]) for w in args.widths}
        xs = [w for w in args.widths if math.isfinite(means[w])]
        errors = [statistics.stdev(losses[w]) / len(losses[w]) ** 0.5 if len(losses[w]) > 1 else 0 for w in xs]
        seeds = max(len(losses[w]) for w in xs)
        label = f"{LABEL[p]} ({seeds} seed{'s' * (seeds > 1)} per width)"
        line = ax.errorbar(xs, [means[w] for w in xs], yerr=errors, marker=marker, capsize=3, label=label)
        for w in xs:
            ax.plot([w] * len(losses[w]), losses[w], marker=marker, linestyle="", alpha=0.3, color=line[0].get_color())
        claims.append(f"{LABEL[p]}: {width_claim(losses, xs)}")
    losses, lrs = tuned_standard(rows, args, width_depth, log2_lr, args.wider_steps)
    if any(lr != log2_lr for lr in lrs.values()):  # standard tuned per width (when the run has it)
        xs = [w for w in args.widths if math.isfinite(statistics.fmean(losses[w]))]
        means = [statistics.fmean(losses[w]) for w in xs]
        errors = [statistics.stdev(losses[w]) / len(losses[w]) ** 0.5 if len(losses[w]) > 1 else 0 for w in xs]
        label = "standard tuned per width (LR " + ", ".join(f"2^{lrs[w]}" for w in xs) + ")"
        ax.errorbar(xs, means, yerr=errors, marker="^", capsize=3, linestyle="--", label=label)
        claims.append(f"standard tuned: {width_claim(losses, xs)}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.widths, [str(w) for w in args.widths])
    ax.set_xlabel("width (hidden size)")
    ax.set_ylabel(f"train loss, last 20% of {args.wider_steps} steps")
    ax.set_title(
        f"Loss vs width at the base model's best LR 2^{log2_lr} ({args.wider_steps} steps, depth {width_depth}, "
        f"head dim {args.head_dim})\nmean ± standard error over seeds, each seed faint",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.02, -0.02, "per doubling ('better': lower by > 2 s.e.; 'tie': within):\n" + "\n".join(claims),
             fontsize=7, va="top")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [
            {
                k: (v if k == "parametrization" else float(v) if k in ("lr", "loss", "seconds") else int(v))
                for k, v in r.items()
            }
            for r in csv.DictReader(f)
        ]


def sweep_report(rows: list[dict], args, width_depth: int) -> tuple[list[dict], list[str]]:
    """The LR sweeps' table (best LR per size with its interval) and summary lines, loss vs width at --steps."""
    table, lines = analyse(rows, args, width_depth)
    sweep_lr = round(base_best_log2_lr(rows, args, width_depth, args.steps)[0])
    return table, lines + wider_is_better(rows, args, width_depth, sweep_lr, args.steps, target=False)


def replot(args, width_depth: int) -> int:
    """The figures again from a finished run's CSV (same analysis, no training); with --sweep-only, the sweep's
    summary and figure from `mup_transfer_sweep.csv` (e.g. after adding a width's runs to it)."""
    if args.sweep_only:
        rows = read_rows(args.out / f"mup_transfer_sweep{args.suffix}.csv")
        return write_sweep(rows, *sweep_report(rows, args, width_depth), args, width_depth, None)
    rows = read_rows(args.out / "mup_transfer.csv")
    base_lr = round(base_best_log2_lr(rows, args, width_depth, args.wider_steps)[0])
    if not plot(rows, args, width_depth, base_lr):
        print("matplotlib missing (pip install -e '.[bench]'): no plot written")
    return 0


def point_of(row: dict) -> tuple:
    return tuple(row[k] for k in ("parametrization", "width", "depth", "log2_lr", "seed", "steps"))


def base_at_horizon(args, common: list[str], width_depth: int, grid: list[int]) -> tuple[list[dict], int, str]:
    """The base model's LR grid at --wider-steps, --lr-seeds seeds per LR (the best LR moves with the horizon):
    its runs, the grid LR nearest the fitted best (where every width then trains), and a sentence with the fit,
    its 95% bootstrap interval and the grid minimum."""
    n = args.wider_steps
    points = [("mup", args.widths[0], width_depth, lr, s, n) for lr in grid for s in range(args.lr_seeds)]
    rows = run_all(points[:1], common, args, workers=1)  # alone first: it tokenizes the corpus the workers read
    rows += run_all(points[1:], common, args)
    fit, grid_best = base_best_log2_lr(rows, args, width_depth, n)
    interval = best_lr_interval(seed_losses(rows, "mup", args.widths[0], width_depth, n))
    ci = f" [95% CI {interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""
    losses = " ".join(f"2^{x}: {y:.4f}" for x, y in curve(rows, "mup", args.widths[0], width_depth, n))
    line = (
        f"base model at {n} steps: best lr 2^{fit:.2f} fitted{ci} (grid minimum 2^{grid_best}; mean loss over "
        f"{args.lr_seeds} seed(s) {losses}); every width trains at the grid LR nearest the fit, 2^{round(fit)}"
    )
    return rows, round(fit), line


def wider_only(args, common: list[str], width_depth: int, log2_lr: int | str) -> int:
    """The loss-vs-width stage alone at a given LR (or, for "base", at the best LR of the base's --lrs grid run
    first at this horizon): µP over --seeds seeds per width, standard over one (and, with --tune-standard, at its
    own best LR per width over --seeds)."""
    started, n, rows, lines, stem = time.perf_counter(), args.wider_steps, [], [], f"{args.wider_steps}"
    if log2_lr == "base":
        first, last = (int(x) for x in args.lrs.split(","))
        rows, log2_lr, line = base_at_horizon(args, common, width_depth, list(range(first, last + 1)))
        lines.append(line)
        stem += "-base"
    points = [("mup", w, width_depth, log2_lr, s, n) for w in args.widths for s in range(args.seeds)]
    points += [("standard", w, width_depth, log2_lr, 0, n) for w in args.widths[1:]]
    done = {point_of(r) for r in rows}
    points = [point for point in points if point not in done]
    if not rows:
        rows = run_all(points[:1], common, args, workers=1)  # alone first: it tokenizes the corpus the workers read
        points = points[1:]
    rows += run_all(points, common, args)
    if args.tune_standard:
        rows = bracket_standard(rows, args, common, width_depth, log2_lr, n)
    lines += wider_is_better(rows, args, width_depth, log2_lr, n, target=True)
    for p in ("mup", "standard"):
        losses = width_losses(rows, args, p, width_depth, log2_lr, n)
        lines.append(f"{LABEL[p]} per doubling: {width_claim(losses, args.widths)}")
    if args.tune_standard:
        lines += tuned_lines(rows, args, width_depth, log2_lr, n)
    rows.sort(key=lambda r: (r["seed"], r["width"], r["parametrization"], r["log2_lr"]))
    write_csv(rows, args.out / f"mup_transfer_wider{stem.replace('-', '_')}.csv")
    elapsed = time.perf_counter() - started
    tuned = ", standard also tuned per width by a bracketed LR search" if args.tune_standard else ""
    (args.out / f"mup_transfer_wider{stem.replace('-', '_')}.md").write_text(
        f"{len(rows)} runs of {n} steps at lr 2^{log2_lr}{tuned} (depth {width_depth}, head dim {args.head_dim}, "
        f"batch 16 x 64 tokens, warmup {max(n // 10, 1)}, cosine to lr/10); {elapsed / 60:.1f} min\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        plot_wider(rows, args, width_depth, log2_lr, args.out / f"wider-is-better-{stem}.png")
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot written")
    print(f"mup transfer (wider only): {len(rows)} runs in {elapsed / 60:.1f} min")
    return 0


def grid_runs(rows: list[dict]) -> str:
    """What each size of a sweep ran, from its rows (a sweep merged from several invocations may differ by size):
    e.g. "width 32 depth 4: 2^-7..2^-4 x 3 seeds"."""
    sizes: dict[tuple, dict[int, set]] = {}
    for r in rows:
        sizes.setdefault((r["width"], r["depth"]), {}).setdefault(r["log2_lr"], set()).add(r["seed"])
    parts = []
    for (width, depth), by_lr in sorted(sizes.items()):
        seeds = sorted({len(v) for v in by_lr.values()})
        parts.append(f"width {width} depth {depth}: 2^{min(by_lr)}..2^{max(by_lr)} x {'/'.join(map(str, seeds))} seeds")
    return "; ".join(parts)


def write_sweep(rows: list[dict], table: list[dict], lines: list[str], args, width_depth: int, elapsed) -> int:
    """--sweep-only's outputs: every run, the best LR per size with its interval, the LR-transfer figure
    (`elapsed` None: re-analysed from the CSV by --replot)."""
    rows.sort(key=lambda r: (r["seed"], r["depth"], r["width"], r["parametrization"], r["log2_lr"]))
    write_csv(rows, args.out / f"mup_transfer_sweep{args.suffix}.csv")
    took = "re-analysed from the CSV (--replot)" if elapsed is None else f"{elapsed / 60:.1f} min"
    (args.out / f"mup_transfer_sweep{args.suffix}.md").write_text(
        f"{len(rows)} runs of {args.optimizer}: lr grid {args.lrs} at {args.steps} steps ({grid_runs(rows)}), "
        f"width sweep at depth {width_depth}, depth sweep at width {args.widths[0]}; {took}\n\n"
        + markdown_table(table, list(table[0]))
        + "\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    print("\n".join(lines))
    if not plot(rows, args, width_depth, None, f"lr-transfer-sweep{args.suffix.replace('_', '-')}.png"):
        print("matplotlib missing (pip install -e '.[bench]'): no plot written")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("mup_transfer", __doc__)
    parser.add_argument("--widths", default="32,64,128,256", help="width sweep; the first is µP's base width")
    parser.add_argument("--depths", default="4,16", help="depth sweep at the first width; the first is µP's base")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the loss-vs-width curve at the base's best LR")
    parser.add_argument("--lr-seeds", type=int, default=3, help="seeds of every point of the LR sweeps (>= 2: CIs)")
    parser.add_argument("--kv-heads", type=int, default=0, help="K/V heads of every model (a fixed K/V width: GQA)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the runs train")
    parser.add_argument(
        "--preset",
        default="cpu",
        choices=("cpu", "gpu"),
        help="gpu: widths 128..2048 (16x, base 128), heads of 64, 256-token sequences, --device cuda, one worker",
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "muon"),
        help="muon: Muon for the layer matrices (µP's Muon LR rule, docs/mup.md), with --sweep-only only; its files "
        "end in _muon / -muon",
    )
    parser.add_argument(
        "--parametrizations",
        default="standard,mup",
        help="which to sweep, of standard,mup (e.g. mup alone: half the runs)",
    )
    parser.add_argument("--lrs", default="-11,-3", help="log2 LR grid: first,last (every integer between)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run of the LR sweeps")
    parser.add_argument("--wider-steps", type=int, default=600, help="steps per run, loss vs width")
    parser.add_argument("--head-dim", type=int, default=16, help="head dim of every model (heads = width / it)")
    parser.add_argument("--workers", type=int, default=2, help="processes running the sweep's runs")
    parser.add_argument(
        "--quick", action="store_true", help="2 widths, 2 depths, 2 LRs, 2 seeds, 3 steps, synthetic text"
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="redraw the figures from --out's mup_transfer.csv (with --sweep-only: the sweep's summary and figure "
        "from mup_transfer_sweep.csv)",
    )
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="only the LR sweeps (no loss-vs-width stage): mup_transfer_sweep.csv/.md and lr-transfer-sweep.png",
    )
    parser.add_argument(
        "--wider-only",
        type=lambda text: text if text == "base" else int(text),
        metavar="LOG2_LR|base",
        help="only the loss-vs-width stage, at this log2 LR and --wider-steps (no sweeps): writes "
        "mup_transfer_wider<N>.csv/.md and wider-is-better-<N>.png; 'base': at the best LR of the base model's "
        "--lrs grid run first at --wider-steps (--lr-seeds seeds per LR; files named <N>_base, <N>-base)",
    )
    parser.add_argument(
        "--tune-standard",
        action="store_true",
        help="with --wider-only: standard parametrization also tuned per width at --wider-steps (a bracketed LR "
        "search per width from the LR µP gives its hidden matrices, then --seeds seeds at the best)",
    )
    parser.add_argument("--bracket-rounds", type=int, default=3, help="--tune-standard: extensions past an edge")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep each finished run's row in --work-dir and read back those of an earlier invocation with the "
        "same settings and the same code (a long sweep stopped part-way reruns only what is missing)",
    )
    args = parser.parse_args(argv)
    args.parametrizations = tuple(p for p in PARAMETRIZATIONS if p in args.parametrizations.split(","))
    if not args.parametrizations:
        parser.error(f"--parametrizations: expected some of {','.join(PARAMETRIZATIONS)}")
    if args.optimizer == "muon" and not args.sweep_only:
        parser.error("--optimizer muon: only with --sweep-only (the loss-vs-width stage is AdamW's)")
    args.suffix = "" if args.optimizer == "adamw" else f"_{args.optimizer}"
    args.optimizer_label = "" if args.optimizer == "adamw" else f" ({args.optimizer})"
    if args.tune_standard and args.wider_only is None:
        parser.error("--tune-standard: only with --wider-only (a full run tunes standard from its own sweep)")
    if args.quick:
        args.widths, args.depths, args.lrs, args.steps, args.workers, args.seeds = "32,64", "1,2", "-7,-6", 3, 1, 2
        args.wider_steps, args.lr_seeds = 4, 2
    seq_len = 64
    if args.preset == "gpu":
        args.widths, args.head_dim, args.device, args.workers, seq_len = "128,256,512,1024,2048", 64, "cuda", 1, 256
    args.widths = [int(w) for w in args.widths.split(",")]
    args.depths = [int(d) for d in args.depths.split(",")]
    first, last = (int(x) for x in args.lrs.split(","))
    grid = list(range(first, last + 1))
    args.shape = [
        "--model.vocab_size=1024",
        f"--model.max_seq_len={seq_len}",
        f"--training.seq_len={seq_len}",
        "--training.micro_batch_size=16",
        "--training.grad_accum_steps=1",
        f"--training.device={args.device}",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    width_depth = args.depths[0]
    if args.replot:
        return replot(args, width_depth)
    common = [
        *corpus_overrides(args.work_dir, args.quick),
        *args.shape,
        "--training.eval_interval=0",
        "--logging.log_interval=1",
        "--optimizer.decay_style=cosine",
        *(["--optimizer.name=muon"] if args.optimizer == "muon" else []),
    ]
    if args.wider_only is not None:
        return wider_only(args, common, width_depth, args.wider_only)
    sizes = [(w, width_depth) for w in args.widths] + [(args.widths[0], d) for d in args.depths[1:]]
    points = [(p, w, d, lr, s, args.steps) for s in range(args.lr_seeds) for w, d in sizes
              for p in args.parametrizations for lr in grid]  # fmt: skip
    started = time.perf_counter()
    # The first run alone, in this process: it tokenizes the corpus into the cache the workers then read.
    rows = run_all(points[:1], common, args, workers=1)
    rows += run_all(points[1:], common, args)
    for w, d in sizes:
        for p in args.parametrizations:
            losses = " ".join(f"{y:.3f}" for _, y in curve(rows, p, w, d, args.steps))
            print(f"  {p:8s} width {w:4d} depth {d:2d}: loss by lr 2^{first}..2^{last}: {losses}", flush=True)
    table, lines = sweep_report(rows, args, width_depth)
    if args.sweep_only:
        return write_sweep(rows, table, lines, args, width_depth, time.perf_counter() - started)
    # Wider is better, at its own horizon: the base's LR grid again, then every width at its best LR (µP over
    # --seeds seeds, since one run's noise is as large as a width doubling's gain; standard over one).
    base, base_lr, line = base_at_horizon(args, common, width_depth, grid)
    rows += base
    lines.append(line)
    done = {point_of(r) for r in base}
    wider = [("mup", w, width_depth, base_lr, s, args.wider_steps) for w in args.widths for s in range(args.seeds)]
    wider += [("standard", w, width_depth, base_lr, 0, args.wider_steps) for w in args.widths[1:]]
    # Standard parametrization tuned per width at this horizon: its own sweep's best LR at each width and the
    # grid steps either side (seed 0), then the best of those over --seeds seeds.
    for w in args.widths[1:]:
        own = round(best_log2_lr(curve(rows, "standard", w, width_depth, args.steps))[0])
        wider += [("standard", w, width_depth, lr, 0, args.wider_steps) for lr in (own - 1, own, own + 1)]
    rows += run_all(sorted(set(wider) - done), common, args)
    tuned = tuned_standard(rows, args, width_depth, base_lr, args.wider_steps)[1]
    extra = [("standard", w, width_depth, lr, s, args.wider_steps) for w, lr in tuned.items() if w != args.widths[0]
             for s in range(1, args.seeds)]  # fmt: skip
    rows += run_all(extra, common, args)
    lines += wider_is_better(rows, args, width_depth, base_lr, args.wider_steps, target=True)
    lines += tuned_lines(rows, args, width_depth, base_lr, args.wider_steps)
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
