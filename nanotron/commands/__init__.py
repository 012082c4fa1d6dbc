"""Every command line of nanotron, one thin module each (parse, call the library, map errors to exit codes).

`nanotron COMMAND [args...]` (the console script) and `python -m nanotron COMMAND [args...]` run them; each takes
--help. `python -m nanotron.train` (and `torchrun -m nanotron.train`) and `python -m nanotron.launch` are the
documented module spellings of `train` and `launch`.
"""

from __future__ import annotations

import importlib
import sys

# command -> module of nanotron.commands
COMMANDS = {
    "train": "train",
    "launch": "launch",
    "torchrun": "torchrun",
    "doctor": "doctor",
    "plan": "plan",
    "tokenize": "tokenize",
    "prepare": "prepare",
    "eval": "eval",
    "generate": "generate",
    "convert": "convert",
    "report": "report",
    "coord-check": "coord_check",
    "config": "config",
}
# Processes nanotron's launchers start on each node; not for typing.
INTERNAL = {"watcher": "watcher", "suspects": "suspects"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    module = COMMANDS.get(command) or INTERNAL.get(command)
    if module is None:
        print(f"usage: nanotron {{{','.join(COMMANDS)}}} [args...]  (each takes --help)", file=sys.stderr)
        return 0 if command in ("-h", "--help") else 2
    return importlib.import_module(f"nanotron.commands.{module}").main(argv[1:]) or 0
