"""What a job that ended with exit code 75 (a node fault) should do next, for `launch/slurm.sh`:

    python -m nanotron.watch.suspects --config CONFIG [--section.key=value ...] [--job JOB_ID]

prints the suspect nodes (comma-separated, what `--exclude` and `ExcNodeList` take) from the run dir's
`suspect_nodes.txt` and records the fault in `node_faults.json`. The no-progress guard: when the last
`watch.max_restarts_without_progress` faults all found the same latest committed checkpoint, the restarts are
not helping (a bad config, or a fault that follows the job from node to node): it prints one `error:` line and
exits 2, and the job is not requeued.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nanotron.checkpoint.layout import latest_checkpoint
from nanotron.config import load_config, parse_overrides
from nanotron.errors import ConfigError, run_command
from nanotron.io import write_atomic


def record_fault(run_dir: Path, checkpoint_dir: Path, limit: int, **details: object) -> None:
    """Adds a node fault to `<run dir>/node_faults.json`; raises a one-line error when the last `limit` faults all
    found the same latest committed checkpoint: restarting is not helping, a person should look."""
    latest = latest_checkpoint(checkpoint_dir)
    history_file = run_dir / "node_faults.json"
    history = json.loads(history_file.read_text()) if history_file.is_file() else []
    history.append({**details, "latest": latest.name if latest else None, "time": time.time()})
    write_atomic(history_file, json.dumps(history, indent=1))
    recent = history[-limit:]
    if len(recent) == limit and len({fault["latest"] for fault in recent}) == 1:
        raise ConfigError(
            f"{limit} node faults in a row without a new checkpoint (latest: {recent[-1]['latest'] or 'none'}; "
            f"{history_file}): not restarting; read the incidents in {run_dir / 'incidents'}, then resubmit "
            "(watch.max_restarts_without_progress)"
        )


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron.watch.suspects", description=__doc__)
    parser.add_argument("--job", default="", help="the scheduler's job id, for the record")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(*parse_overrides(rest))
    suspects_file = cfg.run_dir / "suspect_nodes.txt"
    nodes = suspects_file.read_text().split() if suspects_file.is_file() else []
    limit = cfg.watch.max_restarts_without_progress
    record_fault(cfg.run_dir, cfg.checkpoint_dir, limit, job=args.job, nodes=nodes, action="requeue")
    print(",".join(nodes))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
