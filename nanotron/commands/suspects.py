"""What a job that ended with exit code 75 (a node fault) should do next, for `launch/slurm.sh`:

    python -m nanotron suspects --config CONFIG [--section.key=value ...] [--job JOB_ID]

prints the suspect nodes (comma-separated, what `--exclude` and `ExcNodeList` take) from the run dir's
`suspect_nodes.txt` and records the fault in `node_faults.json`. The no-progress guard: when the last
`watch.max_restarts_without_progress` faults all found the same latest committed checkpoint, the restarts are
not helping (a bad config, or a fault that follows the job from node to node): it prints one `error:` line and
exits 2, and the job is not requeued.
"""

from __future__ import annotations

import argparse

from nanotron.config import load_config, parse_overrides
from nanotron.errors import run_command
from nanotron.watch.suspects import read_suspects, record_fault


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nanotron suspects", description=__doc__)
    parser.add_argument("--job", default="", help="the scheduler's job id, for the record")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(*parse_overrides(rest))
    nodes = read_suspects(cfg.run_dir)
    limit = cfg.watch.max_restarts_without_progress
    record_fault(cfg.run_dir, cfg.checkpoint_dir, limit, job=args.job, nodes=nodes, action="requeue")
    print(",".join(nodes))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)
