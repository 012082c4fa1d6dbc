"""Node faults of a run: `record_fault` keeps `<run dir>/node_faults.json` and stops requeueing when restarts bring
no new checkpoint (watch.max_restarts_without_progress); `nanotron suspects` is its command line for
`launch/slurm.sh`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from nanotron.checkpoint.layout import latest_checkpoint
from nanotron.errors import ConfigError
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
