"""`nanotron coord-check`: µP's coordinate check on your own config, at its own layout.

    nanotron coord-check --config CFG [--widths 64,128,256] [--depths 2,4,8] [--steps 4] [--seeds 1]
                         [--parametrizations standard,mup] [--fixed-head-dim] [--kv-heads N] [--tolerance 0.35]
                         [--out DIR] [--section.key=value ...]

Trains the config's model family for a few steps at each width (at the first depth) and each depth (at the
first width), under standard parametrization and under µP with the first width and depth as its base, each run
a real `nanotron train` at the config's parallel layout (tp/pp/dp/cp, as many processes as it needs), at the
config's learning rate held constant. A family member keeps the config's MLP ratio and head count (head dim
grows; --fixed-head-dim: the head dim stays and heads are added, K/V heads keeping the group size, or fixed at
--kv-heads: with a fixed head dim, a fixed K/V width, whose projections µP scales as output weights). Three
statistics, each a mean |x| per element (an L1 norm per coordinate, as in Yang et al. 2022's coordinate check):

  size    the activations of every step (the trainer's `act/*`): embedding, attention and MLP outputs (mean over
          layers, before µP's branch multiplier), the last layer's residual stream, the final norm, the logits
  change  the same activations' change since initialisation, h_T(x) - h_0(x) on a fixed probe batch (the first
          validation sequences), from the
          run's step-0 and step-T checkpoints
  update  each matrix's update as its output sees it, (W_T - W_0) x on the probe batch (q ... down: mean over
          layers; lm_head with µP's logit multiplier; the embedding's rows)

For each statistic, the slope of log(value) against log(width) and against log(depth) at the last step (a least-
squares fit over the sizes, values averaged over seeds) is the verdict: µP passes when every slope is within
±tolerance (flat: the scale does not drift with size); standard parametrization is expected to fail (its
updates grow with width). Writes coord_check.csv (every value), coord_check.md (the slopes and the verdict) and
coord-check-{width,depth}-{size,change,update}.png (one per sweep and statistic: a column per quantity, standard
above µP on shared y-axes, the step as a colour bar) to --out. Exit status 0 when µP passes (or was not run), 1
when it fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nanotron import records
from nanotron.commands.args import Once, Parser, int_at_least, number_at_least
from nanotron.config import load_config, parse_overrides
from nanotron.coord_check.report import LABEL, PARAMETRIZATIONS, markdown, plot, read_rows, verdicts, write_csv
from nanotron.coord_check.runs import family, measure, parametrization_overrides, probe_batch, run_overrides, train
from nanotron.errors import ConfigError, DataError, run_command
from nanotron.parallel.layout import layout_line


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = Parser(
        prog="nanotron coord-check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", type=Path, action=Once, help="the TOML config whose model family and layout are checked"
    )
    parser.add_argument("--widths", help="hidden sizes, comma-separated; the first is µP's base (default: h/2,h,2h)")
    parser.add_argument("--depths", help="layer counts; the first is µP's base (default: L/2,L,2L)")
    parser.add_argument(
        "--steps", type=int_at_least(1), default=4, help="training steps per run (statistics every step)"
    )
    parser.add_argument(
        "--seeds", type=int_at_least(1), default=1, help="runs per point (error bars, mean for the slopes)"
    )
    parser.add_argument("--parametrizations", default="standard,mup", help="which to run: standard, mup or both")
    parser.add_argument("--fixed-head-dim", action="store_true", help="grow by adding heads of the config's dim")
    parser.add_argument(
        "--kv-heads", type=int_at_least(0), default=0, help="K/V heads of every member (0: the config's group)"
    )
    parser.add_argument(
        "--tolerance", type=number_at_least(0), default=0.35, help="a |log-log slope| up to this is flat"
    )
    parser.add_argument(
        "--probe-tokens", type=int_at_least(1), default=1024, help="validation tokens in the probe batch"
    )
    parser.add_argument("--out", type=Path, default=Path("coord-check"), help="directory for the table and figures")
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: OUT/runs)")
    parser.add_argument("--replot", action="store_true", help="redraw OUT's figures from its coord_check.csv/.json")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if not o.startswith("--") or "." not in o.split("=")[0]]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides are --section.key=value)")
    return args, overrides


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: expected comma-separated positive integers, e.g. 64,128,256") from None
    if len(values) < 2 or min(values) < 1 or len(set(values)) != len(values):
        raise ConfigError(f"{flag}={text!r}: expected at least two distinct positive sizes, e.g. 64,128,256")
    return values


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if args.replot:
        if not (args.out / "coord_check.json").is_file() or not (args.out / "coord_check.csv").is_file():
            raise DataError(
                f"--replot: {args.out} has no coord_check.csv/.json; run the check with --out {args.out} first"
            )
        return 0 if draw(args.out) else 1
    return check(args, overrides)


SAVED = {"steps": records.POSITIVE, "caption": records.Text("a caption (a string)")}  # coord_check.json


def draw(out: Path) -> bool:
    """coord-check-{width,depth}-{size,change,update}.png from OUT's coord_check.csv and .json."""
    hint = f"rerun the check with --out {out} to write it again"
    meta = records.read(out / "coord_check.json", SAVED, DataError, hint)
    rows = read_rows(out / "coord_check.csv", hint)
    figures = [(sweep, stat) for sweep in ("width", "depth") for stat in ("size", "change", "update")]
    have = {(r["sweep"], r["statistic"].split("/")[0]) for r in rows}
    if missing := [f"{sweep} {stat}" for sweep, stat in figures if (sweep, stat) not in have]:  # before any figure
        raise DataError(
            f"'{out / 'coord_check.csv'}' has no rows of {', '.join(missing)}: a check writes the size, change and "
            f"update statistics of both sweeps; {hint}"
        )
    drawn = [
        plot(rows, sweep, stat, meta["steps"], out / f"coord-check-{sweep}-{stat}.png", meta["caption"])
        for sweep, stat in figures
    ]
    if not all(drawn):
        print("matplotlib missing (pip install -e '.[bench]'): no figures written")
    return all(drawn)


def resolve(config: Path | None, overrides: list[str], world_size: int | None = None):
    """The config with `overrides`, validated as `nanotron train` would (a bad key or shape: one line)."""
    path, pairs = parse_overrides([*(["--config", str(config)] if config else []), *overrides])
    return load_config(path, pairs, world_size=world_size)


def check(args: argparse.Namespace, overrides: list[str]) -> int:
    started = time.perf_counter()
    cfg = resolve(args.config, overrides)
    m = cfg.model
    widths = _ints(args.widths, "--widths") if args.widths else [m.hidden_size // 2, m.hidden_size, 2 * m.hidden_size]
    depths = (
        _ints(args.depths, "--depths") if args.depths else [max(m.num_layers // 2, 1), m.num_layers, 2 * m.num_layers]
    )
    chosen = [p.strip() for p in args.parametrizations.split(",")]
    if not chosen or any(p not in PARAMETRIZATIONS for p in chosen):
        raise ConfigError(f"--parametrizations={args.parametrizations!r}: expected standard, mup or standard,mup")
    base = family(cfg, widths[0], depths[0], args.fixed_head_dim, args.kv_heads)
    points = [("width", family(cfg, w, depths[0], args.fixed_head_dim, args.kv_heads)) for w in widths]
    points += [("depth", family(cfg, widths[0], d, args.fixed_head_dim, args.kv_heads)) for d in depths]
    nproc = cfg.world_size
    for _, member in points:  # every shape and layout checked before the first run: one line, nothing trained
        for parametrization in chosen:
            resolve(
                args.config, [*overrides, *member.overrides(), *parametrization_overrides(parametrization, base)], nproc
            )
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or args.out / "runs"
    probe = probe_batch(cfg, args.probe_tokens)
    rows, done = [], {}
    for sweep, member in points:
        for parametrization in chosen:
            for seed in range(args.seeds):
                key = (parametrization, member, seed)
                if key not in done:  # the base is in both sweeps: one run
                    name = f"{parametrization}-w{member.width}-d{member.depth}-s{seed}"
                    extra = [*member.overrides(), *parametrization_overrides(parametrization, base)]
                    extra += run_overrides(cfg, args.steps, work, name, cfg.job.seed + seed)
                    train(args.config, [*overrides, *extra], nproc, work / name)
                    done[key] = measure(work / name, member, args.steps, probe)
                    print(f"  {parametrization:8s} width {member.width:5d} depth {member.depth:3d} seed {seed} done",
                          flush=True)  # fmt: skip
                size = member.width if sweep == "width" else member.depth
                for step, values in done[key].items():
                    for statistic, value in values.items():
                        rows.append(dict(sweep=sweep, parametrization=parametrization, size=size, seed=seed,
                                         step=step, statistic=statistic, value=value))  # fmt: skip
    table = verdicts(rows, args.steps, args.tolerance)
    write_csv(rows, args.out / "coord_check.csv")
    results = {p: all(r[f"{LABEL[p]} flat"] for r in table if f"{LABEL[p]} flat" in r) for p in chosen}
    summary = ", ".join(f"{LABEL[p]} {'passes' if ok else 'fails'}" for p, ok in results.items())
    caption = (
        f"widths {widths} (depth {depths[0]}), depths {depths} (width {widths[0]}); base {widths[0]}x{depths[0]}; "
        f"lr {cfg.optimizer.lr:g} constant, {args.steps} steps, {args.seeds} seed(s), {layout_line(cfg)}"
    )
    (args.out / "coord_check.md").write_text(
        f"Coordinate check of {args.config or 'the defaults'}: {caption}. Slope of log(mean |x|) against "
        f"log(size) at step {args.steps}; flat = |slope| <= {args.tolerance}. **{summary}** "
        f"({len(done)} runs in {(time.perf_counter() - started) / 60:.1f} min).\n\n{markdown(table)}\n"
    )
    (args.out / "coord_check.json").write_text(json.dumps(dict(steps=args.steps, caption=caption)) + "\n")
    print(markdown(table))
    draw(args.out)
    print(f"coord check: {summary} ({len(done)} runs in {time.perf_counter() - started:.0f} s; {args.out})")
    return 0 if results.get("mup", True) else 1


if __name__ == "__main__":
    sys.exit(main())
