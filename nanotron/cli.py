"""The `nanotron` console script: `nanotron COMMAND [args...]` for each command of COMMANDS (each takes --help)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "nanotron.train",
    "launch": "nanotron.launch.cluster",
    "tokenize": "nanotron.tokenize.cli",
    "convert": "nanotron.convert",
    "generate": "nanotron.generate",
    "eval": "nanotron.evaluate",
    "report": "nanotron.report",
    "prepare": "nanotron.prepare",
    "plan": "nanotron.plan.cli",
    "doctor": "nanotron.doctor",
    "coord-check": "nanotron.coord_check.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: nanotron {{{','.join(COMMANDS)}}} [args...]  (each takes --help)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(COMMANDS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
