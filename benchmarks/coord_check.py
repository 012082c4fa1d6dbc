"""Coordinate check: do activations keep their scale as the model grows? Standard parametrization vs µP.

    python -m benchmarks.coord_check [--steps 10] [--seeds 3] [--lr 0.004] [--quick]

A width sweep (64 -> 512, 4 layers) and a depth sweep (4 -> 32 layers, width 128) train a few steps each at one
learning rate (constant, no warmup) and log nanotron's activation statistics every step
(`logging.activation_stats_interval = 1`: mean |x| of the embedding, each layer's attention and MLP output and
residual stream, the final norm, the logits), averaged over seeds. Each sweep's first model is its µP base,
where µP equals standard parametrization. Under µP the curves should stay flat across width and depth; under
standard parametrization (init std 0.02 and one LR at every size) they grow. The depth sweep also runs µP with
depth-µP's alpha = 1/2 next to the default alpha = 1 (CompleteP). Writes scale-across-width.png and
scale-across-depth.png (a row per parametrization, a column per activation, x: width or depth, one line per
step), coord_check.csv (every value) and coord_check.md (each activation's max/min ratio across the sweep at
the last step: means over layers, layers at the same relative depth, and the worst of what compares like for
like) to --out. Data: the Shakespeare corpus of `make data` (synthetic text with --quick).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import DEFAULT_WORK_DIR, RESULTS_DIR, markdown_table, write_csv
from benchmarks.inprocess import corpus_overrides, family_overrides, train_run

# (id, label, overrides) of each parametrization a sweep runs.
STANDARD = ("standard", "standard", [])
MUP = ("mup", "µP", ["--model.parametrization=mup"])
DEPTH_MUP = ("mup-alpha0.5", "µP alpha=1/2", ["--model.parametrization=mup", "--model.mup_depth_exponent=0.5"])
VARIANTS = {"width": (STANDARD, MUP), "depth": (STANDARD, MUP, DEPTH_MUP)}
# What each figure column shows: one activation, or the mean over the layers of a per-layer one.
KINDS = ("embed", "attn", "mlp", "residual", "last residual", "norm", "logits")
# Per-layer activations at the same relative depth (the layer ending the first half, the last layer), which
# is how layers of models of different depths compare. A mean over layers does not: the residual stream grows
# along the depth, and the mean of a 2-layer model weights its last layer 1/2, of a 16-layer model 1/16
# (with linear growth (L+1)/2L: 0.75 vs 0.53, a 1.4x spread however good the parametrization). The depth
# sweep starts at 4 layers: in a 2-layer model the layer ending the first half is layer 0, whose attention
# reads the bare embedding and is several times smaller than every later layer's in every parametrization.
AT_DEPTH = tuple(f"{kind} @{f}" for kind in ("attn", "mlp", "residual") for f in ("1/2", "1"))
# The activations the ≤ 2x target is about: every one a model of each size has, compared like for like.
TARGET_KINDS = ("embed", *AT_DEPTH, "norm", "logits")


def kind_value(record: dict[str, float], kind: str, depth: int) -> float:
    if kind in ("attn", "mlp", "residual"):
        return statistics.fmean(record[f"act/layers.{i}.{kind}"] for i in range(depth))
    if kind == "last residual":
        return record[f"act/layers.{depth - 1}.residual"]
    if kind in AT_DEPTH:
        name, fraction = kind.split(" @")
        layer = max(math.ceil(depth * (0.5 if fraction == "1/2" else 1.0)) - 1, 0)
        return record[f"act/layers.{layer}.{name}"]
    return record[f"act/{kind}"]


def measure(args, data: list[str], sweep: str, variant: tuple, width: int, depth: int) -> list[dict]:
    """Rows (one per step and activation: every per-layer name and every kind), averaged over seeds."""
    variant_id, _, overrides = variant
    base_width, base_depth = (args.widths[0], depth) if sweep == "width" else (width, args.depths[0])
    base = [f"--model.mup_base_width={base_width}", f"--model.mup_base_depth={base_depth}"] if overrides else []
    common = [
        *data,
        *family_overrides(width, depth),
        *overrides,
        *base,
        *args.shape,
        f"--training.steps={args.steps}",
        f"--optimizer.lr={args.lr}",
        f"--optimizer.min_lr={args.lr}",
        "--optimizer.warmup_steps=0",
        "--optimizer.decay_style=constant",
        "--training.eval_interval=0",
        "--logging.activation_stats_interval=1",
    ]
    per_seed = []
    for seed in range(args.seeds):
        name = f"coord-{sweep}-{variant_id}-w{width}-d{depth}-s{seed}"
        records, _ = train_run(name, [*common, f"--job.seed={seed}"], args.work_dir)
        per_seed.append({r["step"]: r for r in records if "act/embed" in r})
    rows = []
    size = width if sweep == "width" else depth
    for step in range(1, args.steps + 1):
        seeds = [by_step[step] for by_step in per_seed if step in by_step]  # a diverged seed stops early
        if not seeds:
            continue
        names = [k.removeprefix("act/") for k in seeds[0] if k.startswith("act/")]
        values = {n: statistics.fmean(s[f"act/{n}"] for s in seeds) for n in names}
        values |= {kind: statistics.fmean(kind_value(s, kind, depth) for s in seeds) for kind in (*KINDS, *AT_DEPTH)}
        for activation, l1 in values.items():
            row = dict(sweep=sweep, parametrization=variant_id, size=size, step=step, activation=activation, l1=l1)
            rows.append(row | {"seeds": len(seeds)})
    return rows


def spreads(rows: list[dict], sweep: str, variant_id: str, last_step: int) -> dict[str, float]:
    """Each activation's max/min ratio across the sweep's sizes at the last step (names every size has)."""
    by_activation: dict[str, dict[int, float]] = {}
    for r in rows:
        if (r["sweep"], r["parametrization"], r["step"]) == (sweep, variant_id, last_step):
            by_activation.setdefault(r["activation"], {})[r["size"]] = r["l1"]
    sizes = {r["size"] for r in rows if r["sweep"] == sweep}
    return {a: max(v.values()) / min(v.values()) for a, v in by_activation.items() if set(v) == sizes}


def summary(rows: list[dict], last_step: int) -> list[dict]:
    """A row per kind (means over layers, then layers at the same relative depth), one for the worst single
    per-layer activation of the width sweep (its layers are the same at every width), and the worst of what the
    target compares (TARGET_KINDS, and in the width sweep every per-layer activation); a column per sweep and
    parametrization."""
    worst_layer, worst_all = "worst per-layer (width)", "worst compared (target: ≤ 2 under µP)"
    table = {kind: {"activation": kind} for kind in (*KINDS, *AT_DEPTH, worst_layer, worst_all)}
    for sweep, variants in VARIANTS.items():
        for variant_id, label, _ in variants:
            spread = spreads(rows, sweep, variant_id, last_step)
            column = f"{sweep} {label}"
            for kind in (*KINDS, *AT_DEPTH):
                table[kind][column] = spread[kind]
            compared = {k: spread[k] for k in TARGET_KINDS}
            table[worst_layer][column] = ""
            if sweep == "width":
                layers = {a: s for a, s in spread.items() if a.startswith("layers.")}
                worst = max(layers, key=layers.get)
                table[worst_layer][column] = f"{layers[worst]:.3g} ({worst})"
                compared |= layers
            worst = max(compared, key=compared.get)
            table[worst_all][column] = f"{compared[worst]:.3g} ({worst})"
    return list(table.values())


def plot(rows: list[dict], sweep: str, sizes: list[int], steps: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    variants = VARIANTS[sweep]
    fig, axes = plt.subplots(len(variants), len(KINDS), figsize=(3.0 * len(KINDS), 3.1 * len(variants)), sharex=True)
    colors = plt.get_cmap("viridis")
    for row, (variant_id, label, _) in enumerate(variants):
        for col, kind in enumerate(KINDS):
            ax = axes[row][col]
            for step in range(1, steps + 1):
                key = (sweep, variant_id, kind, step)
                points = {r["size"]: r["l1"] for r in rows if (r["sweep"], r["parametrization"], r["activation"],
                          r["step"]) == key}  # fmt: skip
                xs = [s for s in sizes if s in points]
                color = colors((step - 1) / max(steps - 1, 1))
                ax.plot(xs, [points[s] for s in xs], marker="o", markersize=3, color=color, label=f"step {step}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_title(f"{label}: {kind}", fontsize=9)
            if row == len(variants) - 1:
                ax.set_xlabel("width (hidden size)" if sweep == "width" else "depth (layers)")
            if col == 0:
                ax.set_ylabel("mean |x| (L1 per element)")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"Activation scale across {sweep}: a row per parametrization, a line per step (1-{steps})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="64,128,256,512", help="width sweep (4 layers); the first is µP's base")
    parser.add_argument("--depths", default="4,8,16,32", help="depth sweep (width 128); the first is µP's base")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (statistics every step)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per point, averaged")
    parser.add_argument("--lr", type=float, default=2**-8, help="the one (constant) learning rate")
    parser.add_argument("--quick", action="store_true", help="2 widths, 2 depths, 2 steps, synthetic text: seconds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.depths, args.steps, args.seeds = "32,64", "1,2", 2, 1
    args.widths = [int(w) for w in args.widths.split(",")]
    args.depths = [int(d) for d in args.depths.split(",")]
    args.shape = [
        "--model.vocab_size=1024",
        "--model.max_seq_len=64",
        "--training.seq_len=64",
        "--training.micro_batch_size=8",
        "--training.grad_accum_steps=1",
    ]
    data = corpus_overrides(args.work_dir, args.quick)
    width_depth, depth_width = (1, args.widths[0]) if args.quick else (4, 128)
    points = [("width", w, width_depth) for w in args.widths] + [("depth", depth_width, d) for d in args.depths]
    started, rows, runs = time.perf_counter(), [], 0
    for sweep, width, depth in points:
        for variant in VARIANTS[sweep]:
            rows += measure(args, data, sweep, variant, width, depth)
            runs += args.seeds
            print(f"  {sweep:5s} {variant[0]:12s} width {width:4d} depth {depth:3d} done", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "coord_check.csv")
    table = summary(rows, args.steps)
    markdown = markdown_table(table, list(table[0]))
    (args.out / "coord_check.md").write_text(
        f"Max/min ratio of mean |x| across widths {args.widths} (depth {width_depth}) and depths {args.depths} "
        f"(width {depth_width}) at step {args.steps} (lr {args.lr:g}, {args.seeds} seeds per point, "
        f"{runs} runs in {(time.perf_counter() - started) / 60:.1f} min):\n\n{markdown}\n"
    )
    print(markdown)
    drawn = [plot(rows, s, sizes, args.steps, args.out / f"scale-across-{s}.png")
             for s, sizes in (("width", args.widths), ("depth", args.depths))]  # fmt: skip
    if not all(drawn):
        print("matplotlib missing (pip install -e '.[bench]'): no plot written")
    print(f"coord check: {runs} runs in {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
