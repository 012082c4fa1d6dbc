"""`nanotron torchrun [torchrun options] -m nanotron.train ...`: torchrun with the exit codes and signals a job
needs (`nanotron.launch.torchrun`); what `--nproc_per_node` and `launch/slurm.sh` start on each node."""

from __future__ import annotations

import sys

from nanotron.errors import run_command
from nanotron.launch.torchrun import run_torchrun


def main(argv: list[str] | None = None) -> int:
    return run_command(run_torchrun, list(sys.argv[1:] if argv is None else argv))
