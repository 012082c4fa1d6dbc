"""Is Muon worth using here? Muon against AdamW on `configs/tiny.toml`, each at its own best learning rate.

    python -m benchmarks.muon_quality [--steps 300] [--seeds 3] [--adamw-lrs=-10,-9,-8] [--muon-lrs=-10,-9,-8]
                                      [--adamw-horizon 600] [--timing-steps 10] [--quick] [--resume]
    python -m benchmarks.muon_quality --small-step     # one micro-batch and one optimizer step of configs/small.toml

Each run is one process of `configs/tiny.toml` (hidden 128, 4 layers, vocab 8192, batch 16 x 128 tokens) on the
Shakespeare corpus of `make data` (the synthetic corpus and the nano model with --quick), warmup 10% of the steps,
cosine decay to lr/10, the config's weight decay 0.1. Muon (`optimizer.name = "muon"`) takes AdamW's place for the
decoder layers' matrices only, at the same LR (Moonlight's update-RMS scaling makes it AdamW-comparable); the
embedding, head and norms stay on AdamW. First a learning-rate sweep per optimizer (seed 0 at each log2 LR of its
list), the best LR being the lowest mean training loss over the last 20% of the steps (every batch is new to the
model: less than one pass over the data), then --seeds - 1 more seeds at that LR. Reported, mean and spread over
the seeds at each optimizer's best LR: the training loss (a 10-step rolling mean) at a quarter, half and all of the
steps, the validation loss at the end, and the first step at which AdamW's seed-mean curve reaches Muon's final
loss, and Muon's loss at every tenth of the run (Muon's "speed-up" in steps; "> steps": not reached). Where AdamW
does not get there within --steps, --adamw-horizon N trains it again at its best LR over an N-step schedule (its
own warm-up and cosine; --seeds seeds) and reports the first step of that seed-mean curve at Muon's final loss.

The optimizer's share of a training step is timed separately, in this process on one thread: the same model and
batch, forward and backward of the config's micro-batches, then `optimizer.step()` alone, medians over
--timing-steps steps after 2 warm-up steps (not the trainer's loop: no data loading or logging in the timed part).
--small-step times configs/small.toml (162M parameters, seq 2048, fp32): one micro-batch's forward and backward,
then each optimizer's first step on those gradients (once, cold), to state what the issue's config costs on this CPU.
Writes muon_quality.csv (every run's row), muon_quality.md (the sweep, the comparison, the step-time shares) and
muon_quality.png (loss vs step, mean ± spread over seeds, both optimizers) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    REPO,
    RESULTS_DIR,
    RunCache,
    bench_parser,
    markdown_table,
    source_digest,
    write_csv,
)
from benchmarks.inprocess import late_train_loss, train_run

OPTIMIZERS = ("adamw", "muon")
WINDOW = 10  # the rolling mean over which a curve's loss at a step is read


def run_overrides(optimizer: str, log2_lr: int, seed: int, args: argparse.Namespace, steps: int = 0) -> list[str]:
    lr, steps = 2.0**log2_lr, steps or args.steps
    return [
        "--config",
        str(REPO / "configs" / "tiny.toml"),
        *args.shape,
        *args.data,
        f"--optimizer.name={optimizer}",
        f"--optimizer.lr={lr}",
        f"--optimizer.min_lr={lr / 10}",
        f"--optimizer.warmup_steps={max(steps // 10, 1)}",
        "--optimizer.decay_style=cosine",
        f"--job.seed={seed}",
        f"--training.steps={steps}",
        f"--training.eval_interval={steps}",
        "--training.eval_steps=8",
        "--logging.log_interval=1",
    ]


def run(optimizer: str, log2_lr: int, seed: int, args: argparse.Namespace, steps: int = 0) -> dict:
    """One training run of `steps` (default --steps) in this process; its row (the per-step losses kept for the
    curves)."""
    steps = steps or args.steps
    point = (optimizer, log2_lr, seed) if steps == args.steps else (optimizer, log2_lr, seed, steps)
    cached = args.cache.get(point)
    if cached is not None:
        return cached
    started = time.perf_counter()
    name = f"muon_quality-{optimizer}-lr{log2_lr}-s{seed}-n{steps}"
    records, finished = train_run(name, run_overrides(optimizer, log2_lr, seed, args, steps), args.work_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    row = dict(optimizer=optimizer, log2_lr=log2_lr, seed=seed, steps=steps,
               late_loss=late_train_loss(records, finished), eval_loss=evals[-1] if evals and finished else math.inf,
               seconds=round(time.perf_counter() - started, 1), losses=losses)  # fmt: skip
    print(
        f"  {optimizer} lr 2^{log2_lr} seed {seed} ({steps} steps): late loss {row['late_loss']:.4f} in "
        f"{row['seconds']} s",
        flush=True,
    )
    args.cache.put(point, row)
    return row


def run_cache(args: argparse.Namespace) -> RunCache:
    """--resume: finished runs' rows in `<work dir>/muon_quality_runs.jsonl`, each under its overrides and the code's
    hash: a row trained by other code (a trainer fix since) is run again, not read back."""
    code = source_digest() if args.resume else ""

    def key(point: tuple) -> str:
        return json.dumps([code, run_overrides(*point[:3], args, *point[3:])])

    return RunCache(args.work_dir / "muon_quality_runs.jsonl", args.resume, key)


def rolling(values: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def mean_curve(rows: list[dict]) -> list[float]:
    """The seeds' mean of each step's rolling-mean training loss."""
    return [statistics.fmean(step) for step in zip(*(rolling(r["losses"]) for r in rows))]


def steps_to_reach(curve: list[float], target: float) -> int | None:
    """The first step (1-based) at which `curve` is at or below `target`; None if it never is."""
    return next((i + 1 for i, y in enumerate(curve) if y <= target), None)


def spread(values: list[float]) -> str:
    """mean ± sample standard deviation (the seeds' spread), or the one value."""
    if len(values) < 2:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def compare(final: dict[str, list[dict]], steps: int) -> tuple[list[dict], list[str]]:
    """The table at equal steps (each optimizer at its best LR) and the sentences: the loss gap, the steps AdamW
    needs to reach Muon's final loss."""
    marks = sorted({max(steps // 4, 1), max(steps // 2, 1), steps})
    table = []
    for optimizer in OPTIMIZERS:
        rows = final[optimizer]
        row = {"optimizer": optimizer, "log2 lr": rows[0]["log2_lr"], "seeds": len(rows)}
        for mark in marks:
            row[f"train loss @ {mark}"] = spread([rolling(r["losses"])[mark - 1] for r in rows])
        row["eval loss (end)"] = spread([r["eval_loss"] for r in rows])
        table.append(row)
    muon, adamw = mean_curve(final["muon"]), mean_curve(final["adamw"])
    reached = steps_to_reach(adamw, muon[-1])
    gap = [a - m for a, m in zip(adamw, muon)]
    eval_gap = statistics.fmean(r["eval_loss"] for r in final["adamw"]) - statistics.fmean(
        r["eval_loss"] for r in final["muon"]
    )
    lines = [
        f"AdamW minus Muon, seed-mean training loss ({WINDOW}-step rolling mean): "
        + ", ".join(f"{gap[m - 1]:+.4f} at step {m}" for m in marks)
        + f"; validation loss at the end: {eval_gap:+.4f}",
        (
            f"AdamW's seed-mean curve reaches Muon's final loss ({muon[-1]:.4f} at step {steps}) at step {reached}: "
            f"AdamW needs {reached / steps:.2f}x Muon's steps for it"
        )
        if reached
        else (
            f"AdamW's seed-mean curve does not reach Muon's final loss ({muon[-1]:.4f} at step {steps}) within "
            f"{steps} steps (its own final: {adamw[-1]:.4f}): AdamW needs more than {steps} steps for it"
        ),
    ]
    reach = []
    for mark in range(max(steps // 10, 1), steps + 1, max(steps // 10, 1)):
        needed = steps_to_reach(adamw, muon[mark - 1])
        reach.append(f"{mark}: {needed} ({needed / mark:.2f}x)" if needed else f"{mark}: > {steps}")
    lines.append("steps AdamW's seed-mean curve needs to reach Muon's loss at Muon's step k: " + ", ".join(reach))
    return table, lines


def horizon_line(longer: list[dict], final: dict[str, list[dict]], steps: int) -> str:
    """Where AdamW, trained over a longer schedule, reaches Muon's final loss: the first step of its seed-mean curve
    at or below Muon's seed-mean loss at step `steps`."""
    target = mean_curve(final["muon"])[-1]
    curve, horizon = mean_curve(longer), len(longer[0]["losses"])
    reached = steps_to_reach(curve, target)
    head = (
        f"AdamW at 2^{longer[0]['log2_lr']} over a {horizon}-step schedule ({len(longer)} seeds; its own warm-up and "
        f"cosine decay, so its curve at step k is not that of a k-step run): "
    )
    if reached is None:
        return (
            head + f"does not reach Muon's final loss ({target:.4f} at step {steps}) in {horizon} steps (its own "
            f"final: {curve[-1]:.4f}): AdamW needs more than {horizon / steps:.1f}x Muon's steps"
        )
    return (
        head + f"reaches Muon's final loss ({target:.4f} at step {steps}) at step {reached}: "
        f"{reached / steps:.2f}x Muon's steps (its final: {curve[-1]:.4f})"
    )


def step_share(overrides: list[str], optimizer: str, repeats: int, device: str = "cpu") -> dict:
    """Median seconds of forward + backward over the config's micro-batches and of `optimizer.step()` alone, for
    one model on `device` (one process, no parallelism): what the optimizer's share of a training step is."""
    from nanotron.config import load_config, parse_overrides
    from nanotron.models.llama import LlamaForCausalLM
    from nanotron.optim import build_optimizer, set_lr
    from nanotron.parallel.init import init_weights

    cfg = load_config(*parse_overrides([*overrides, f"--optimizer.name={optimizer}", "--parallelism.dp=1"]))
    target = torch.device(device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.training.dtype]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    model = model.to_empty(device=target)
    init_weights(model, cfg.job.seed)
    opt = build_optimizer(model, cfg.optimizer, target, cfg.model)
    set_lr(opt, cfg.optimizer.lr)
    micro, accum = cfg.training.micro_batch_size, cfg.training.global_batch_size // cfg.training.micro_batch_size
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (micro, cfg.training.seq_len + 1), generator=generator)
    batch = batch.to(target)
    sync = torch.cuda.synchronize if target.type == "cuda" else (lambda: None)
    backward, step = [], []
    for i in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        for _ in range(accum):
            with torch.autocast(target.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            (loss / accum).backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if i >= 2:  # warm-up: the first steps allocate
            backward.append(t1 - t0)
            step.append(t2 - t1)
    fwd_bwd, opt_step = statistics.median(backward), statistics.median(step)
    return dict(optimizer=optimizer, micro_batches=accum, forward_backward_s=round(fwd_bwd, 4),
                optimizer_step_s=round(opt_step, 4), share=round(opt_step / (fwd_bwd + opt_step), 4))  # fmt: skip


def small_step(args: argparse.Namespace) -> int:
    """One micro-batch (forward + backward) of configs/small.toml in fp32 on this CPU, then one optimizer step of
    each optimizer on its gradients (cold: the first step, allocations included)."""
    from nanotron.config import load_config, parse_overrides
    from nanotron.models.llama import LlamaForCausalLM
    from nanotron.optim import build_optimizer
    from nanotron.parallel.init import init_weights

    overrides = ["--config", str(REPO / "configs" / "small.toml"), "--training.dtype=float32", "--parallelism.dp=1"]
    cfg = load_config(*parse_overrides(overrides))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    model = model.to_empty(device="cpu")
    init_weights(model, cfg.job.seed)
    optimizers = {}  # built first: building one creates its state with a throw-away step that clears the grads
    for optimizer in OPTIMIZERS:
        opt_cfg = load_config(*parse_overrides([*overrides, f"--optimizer.name={optimizer}"])).optimizer
        optimizers[optimizer] = build_optimizer(model, opt_cfg, torch.device("cpu"), cfg.model)
    micro, seq = cfg.training.micro_batch_size, cfg.training.seq_len
    batch = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    logits = model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    fwd_bwd = time.perf_counter() - started
    steps = {}
    for optimizer, opt in optimizers.items():  # each on the same gradients
        started = time.perf_counter()
        opt.step()
        steps[optimizer] = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    accum = cfg.training.global_batch_size // micro
    print(
        f"configs/small.toml ({params / 1e6:.0f}M parameters, fp32, 1 process, 1 thread): one micro-batch of {micro} x "
        f"{seq} tokens forward + backward {fwd_bwd:.1f} s; optimizer step adamw {steps['adamw']:.2f} s, muon "
        f"{steps['muon']:.2f} s; its global batch ({cfg.training.global_batch_size} sequences = {accum} micro-batches) "
        f"would take ~{accum * fwd_bwd / 60:.0f} min per step here",
        flush=True,
    )
    return 0


def plot(final: dict[str, list[dict]], path: Path, label: str, longer: list[dict] = ()) -> bool:
    """Training loss vs step (rolling mean), mean over seeds with a band of ± one standard deviation; AdamW over
    the longer horizon dashed, with Muon's final loss as a horizontal line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for optimizer in OPTIMIZERS:
        curves = [rolling(r["losses"]) for r in final[optimizer]]
        mean = [statistics.fmean(step) for step in zip(*curves)]
        std = [statistics.stdev(step) if len(step) > 1 else 0.0 for step in zip(*curves)]
        xs = range(1, len(mean) + 1)
        lr = final[optimizer][0]["log2_lr"]
        ax.plot(xs, mean, label=f"{optimizer} at lr 2^{lr} ({len(curves)} seeds)")
        ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25)
    if longer:
        mean = mean_curve(longer)
        lr = longer[0]["log2_lr"]
        ax.plot(range(1, len(mean) + 1), mean, "--", label=f"adamw at lr 2^{lr}, {len(mean)}-step schedule")
        ax.axhline(mean_curve(final["muon"])[-1], color="grey", lw=0.8, label="muon's final loss")
    tail = [
        y for optimizer in OPTIMIZERS for r in final[optimizer] for y in rolling(r["losses"])[len(r["losses"]) // 5 :]
    ]
    ax.set_ylim(min(tail) - 0.05, max(tail) + 0.05)
    ax.set(xlabel="step", ylabel=f"training loss ({WINDOW}-step rolling mean)", title=f"{label}: mean ± std over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("muon_quality", __doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at each optimizer's best LR (seed 0: the sweep's)")
    parser.add_argument("--adamw-lrs", default="-10,-9,-8", help="AdamW's log2 LR sweep, comma-separated")
    parser.add_argument("--muon-lrs", default="-10,-9,-8", help="Muon's log2 LR sweep, comma-separated")
    parser.add_argument(
        "--adamw-horizon",
        type=int,
        default=0,
        help="then AdamW at its best LR over this many steps (its own schedule), --seeds seeds: the step at which it "
        "reaches Muon's final loss (0: not run; with --quick: 12)",
    )
    parser.add_argument("--timing-steps", type=int, default=10, help="timed steps of the optimizer-share measurement")
    parser.add_argument("--small-step", action="store_true", help="only time one step of configs/small.toml")
    parser.add_argument("--quick", action="store_true", help="nano model, synthetic text, 6 steps, 2 LRs, 2 seeds")
    parser.add_argument("--resume", action="store_true", help="read back runs finished by an earlier invocation")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.small_step:
        return small_step(args)
    lrs = {}
    for optimizer in OPTIMIZERS:
        text = getattr(args, f"{optimizer}_lrs")
        try:
            lrs[optimizer] = [int(x) for x in text.split(",")]
        except ValueError:
            parser.error(f"--{optimizer}-lrs={text}: expected comma-separated integers (log2 LRs), e.g. -10,-9,-8")
    if args.quick:
        args.steps, args.seeds, args.timing_steps = 6, 2, 1
        args.adamw_horizon = args.adamw_horizon and 12
        lrs = {optimizer: values[:2] for optimizer, values in lrs.items()}
    if args.adamw_horizon and args.adamw_horizon <= args.steps:
        parser.error(f"--adamw-horizon={args.adamw_horizon}: expected more steps than --steps={args.steps}, or 0")
    from benchmarks.common import ensure_data, model_overrides
    from benchmarks.inprocess import corpus_overrides

    if args.quick:
        args.shape, args.data = model_overrides("nano"), ensure_data(args.work_dir)
    else:
        args.shape, args.data = [], corpus_overrides(args.work_dir, False, vocab_size=8192)
    args.cache = run_cache(args)
    started = time.perf_counter()
    rows, sweep, final = [], [], {}
    for optimizer in OPTIMIZERS:  # both sweeps first, then the seeds in turns: a run cut short is still fair
        runs = [run(optimizer, lr, 0, args) for lr in lrs[optimizer]]
        best = min(runs, key=lambda r: r["late_loss"])
        edge = " (grid edge)" if best["log2_lr"] in (min(lrs[optimizer]), max(lrs[optimizer])) else ""
        sweep.append({"optimizer": optimizer, **{f"2^{r['log2_lr']}": r["late_loss"] for r in runs},
                      "best": f"2^{best['log2_lr']}{edge}"})  # fmt: skip
        final[optimizer] = [best]
        rows += runs
    for seed in range(1, args.seeds):
        for optimizer in OPTIMIZERS:
            final[optimizer].append(run(optimizer, final[optimizer][0]["log2_lr"], seed, args))
            rows.append(final[optimizer][-1])
    table, lines = compare(final, args.steps)
    longer = []
    if args.adamw_horizon:  # AdamW given more steps, each run its own warm-up and cosine over the longer horizon
        longer = [run("adamw", final["adamw"][0]["log2_lr"], s, args, args.adamw_horizon) for s in range(args.seeds)]
        rows += longer
        lines.append(horizon_line(longer, final, args.steps))
    timing_overrides = ["--config", str(REPO / "configs" / "tiny.toml"), *args.shape, *args.data]
    shares = [step_share(timing_overrides, optimizer, args.timing_steps) for optimizer in OPTIMIZERS]
    elapsed = time.perf_counter() - started
    write_csv(rows, args.out / "muon_quality.csv", [k for k in rows[0] if k != "losses"])
    sweep_columns = list(dict.fromkeys(k for row in sweep for k in row if k != "best")) + ["best"]
    model = "nano (--quick)" if args.quick else "configs/tiny.toml"
    (args.out / "muon_quality.md").write_text(
        f"{len(rows)} runs of {args.steps} steps ({model}); {elapsed / 60:.1f} min\n\n"
        f"LR sweep (seed 0, late training loss: mean of the last 20% of the steps)\n\n"
        + markdown_table(sweep, sweep_columns)
        + f"\n\nAt each optimizer's best LR, mean ± std over seeds\n\n{markdown_table(table, list(table[0]))}\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + f"\n\nOptimizer step as a share of a training step (CPU, one thread, medians of {args.timing_steps})\n\n"
        + markdown_table(shares, list(shares[0]))
        + "\n"
    )
    print(markdown_table(table, list(table[0])) + "\n" + "\n".join(lines))
    print(markdown_table(shares, list(shares[0])))
    if not plot(final, args.out / "muon_quality.png", model, longer):
        print("matplotlib missing (pip install -e '.[bench]'): no plot written")
    print(f"muon quality: {len(rows)} runs in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
