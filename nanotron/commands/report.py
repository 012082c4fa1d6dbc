"""A run's figures and summary from its metrics.jsonl alone (works on any run dir, also one copied off a cluster):

    nanotron report RUN_DIR [--out DIR]

Writes figures as PNG, PDF and SVG (loss and validation loss, downstream scores against chance with error bars,
learning rate, gradient norm, memory, tokens/s, step time, TFLOP/s, MFU in %, activation statistics, the max and the
worst 3 ranks' straggler scores; units on every axis, spikes and rollbacks marked on the loss) and `summary.md`
(config, layout, steps, duration, tokens, best scores, incidents) to DIR (default RUN_DIR/report). Needs matplotlib
(`pip install ".[bench]"`). Records a resumed run wrote twice (the steps between its checkpoint and a kill) count
once: the later record of a step wins.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanotron.commands.args import Parser
from nanotron.console import format_duration
from nanotron.errors import DataError, run_command
from nanotron.io import check_writable, write_atomic
from nanotron.metrics.report import duration, events, figures, read_records, series, summary


def _main(argv: list[str]) -> int:
    parser = Parser(prog="nanotron report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="where figures and summary.md go (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    records = read_records(args.run_dir)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DataError("nanotron report draws with matplotlib: pip install '.[bench]' (or matplotlib)") from None
    out = args.out or args.run_dir / "report"
    check_writable("--out", out)
    data, found, seconds = series(records), events(records), duration(records)
    caption = args.run_dir.resolve().name + (f", {format_duration(seconds)}" if seconds is not None else "")
    written = figures(data, found, out, caption)
    write_atomic(out / "summary.md", summary(args.run_dir, data, found, written, seconds), durable=False)
    print(f"report: {len(written)} figures and summary.md in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)
