"""Node faults of a run: `<run dir>/suspect_nodes.txt` (the nodes a requeue leaves out, written here only, by whoever
names them: the watcher, the doctor, the trainer carrying out a stability or straggler decision) and
`record_fault`, which keeps `<run dir>/node_faults.json` and stops requeueing when restarts bring no new checkpoint
(watch.max_restarts_without_progress); `nanotron suspects` is their command line for `launch/slurm.sh`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

from nanotron.checkpoint.layout import latest_checkpoint
from nanotron.errors import ConfigError
from nanotron.io import write_atomic

SUSPECTS_FILE = "suspect_nodes.txt"


def write_suspects(run_dir: Path, nodes: Iterable[str]) -> None:
    """The nodes a requeue of the job leaves out, one per line, sorted."""
    write_atomic(run_dir / SUSPECTS_FILE, "".join(f"{node}\n" for node in sorted(set(nodes))))


def read_suspects(run_dir: Path) -> list[str]:
    path = run_dir / SUSPECTS_FILE
    return path.read_text().split() if path.is_file() else []


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
