"""Configs from other frameworks, as this project's TOML:

    nanotron config from-nanotron OLD.yaml [--out NEW.toml]

from-nanotron converts a config of the original nanotron (huggingface/nanotron's YAML: general, parallelism, model,
tokens, optimizer, checkpoints, data_stages, ...) and prints it, or writes it to --out. Each key it does not carry
over, and each step to take before training (tokenize a hub dataset, fetch a tokenizer), is a `note:` line on
stderr and a comment at the top of the TOML. The TOML is checked by loading it: a config this project refuses is
one error naming the original's keys. docs/coming-from-nanotron.md maps every key (and torchtitan's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanotron.commands.args import Parser
from nanotron.config.from_nanotron import convert
from nanotron.errors import run_command, storage_errors
from nanotron.io import check_not_input, check_writable_file, write_atomic


def _main(argv: list[str]) -> int:
    parser = Parser(prog="nanotron config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="from-nanotron", required=True)
    original = commands.add_parser("from-nanotron", help="the original nanotron's YAML config -> TOML")
    original.add_argument("yaml", type=Path, help="the original's config file, e.g. config_tiny_llama.yaml")
    original.add_argument("--out", type=Path, help="write the TOML to this file instead of printing it")
    args = parser.parse_args(argv)
    if args.out is not None:  # before the work, and never over the YAML it reads
        check_writable_file("--out", args.out)
        check_not_input("--out", args.out, [args.yaml])
    text, notes = convert(args.yaml)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    with storage_errors("write", args.out):
        write_atomic(args.out, text, durable=False)
    print(f"config: wrote {args.out} ({len(notes)} notes); train with `python -m nanotron.train --config {args.out}`")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)
