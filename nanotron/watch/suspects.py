"""Node faults of a run: `<run dir>/suspect_nodes.txt` (the nodes a requeue leaves out, written here only, by whoever
names them: the watcher, the doctor, the trainer carrying out a stability or straggler decision) and
`record_fault`, which keeps `<run dir>/node_faults.json` and stops requeueing when restarts bring no new checkpoint
(watch.max_restarts_without_progress); `nanotron suspects` is their command line for `launch/slurm.sh`."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from nanotron import records
from nanotron.checkpoint.layout import latest_checkpoint
from nanotron.errors import ConfigError
from nanotron.io import write_atomic

SUSPECTS_FILE = "suspect_nodes.txt"


def write_suspects(run_dir: Path, nodes: Iterable[str]) -> None:
    """The nodes a requeue of the job leaves out, one per line, sorted."""
    write_atomic(run_dir / SUSPECTS_FILE, "".join(f"{node}\n" for node in sorted(set(nodes))))


NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a host name: what --exclude and ExcNodeList take


def read_suspects(run_dir: Path) -> list[str]:
    """The suspect nodes, each once, in the file's order (one per line; commas and spaces also separate)."""
    path = run_dir / SUSPECTS_FILE
    if not path.is_file():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"'{path}' is not text (node names, one per line); fix or move it aside") from None
    nodes = [name for name in re.split(r"[\s,]+", text) if name]
    for name in nodes:
        if not NODE_NAME.fullmatch(name):
            raise ConfigError(f"'{path}': {name!r} is not a node name (letters, digits, '.', '_', '-'); fix it")
    return list(dict.fromkeys(nodes))


def _fault_history(history_file: Path) -> list[dict]:
    """The recorded faults; a file that is not a JSON list of faults is moved aside (kept, named in a warning)
    and the history starts again: the requeue it decides must not fail on it."""
    if not history_file.is_file():
        return []
    try:
        history = json.loads(history_file.read_bytes())
        if records.problem(history, [{}]) is None:  # a list of JSON objects
            return history
        reason = "not a JSON list of faults"
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        reason = f"not JSON: {error}"
    aside = history_file.with_name(f"{history_file.name}.unreadable-{time.time_ns()}")
    history_file.rename(aside)
    print(f"warning: {history_file} was {reason}; moved to {aside}, the fault history starts again", file=sys.stderr)
    return []


def record_fault(run_dir: Path, checkpoint_dir: Path, limit: int, **details: object) -> None:
    """Adds a node fault to `<run dir>/node_faults.json`; raises a one-line error when the last `limit` faults all
    found the same latest committed checkpoint: restarting is not helping, a person should look."""
    latest = latest_checkpoint(checkpoint_dir)
    history_file = run_dir / "node_faults.json"
    history = _fault_history(history_file)
    history.append({**details, "latest": latest.name if latest else None, "time": time.time()})
    write_atomic(history_file, json.dumps(history, indent=1))
    recent = history[-limit:]
    if len(recent) == limit and len({fault["latest"] for fault in recent}) == 1:
        raise ConfigError(
            f"{limit} node faults in a row without a new checkpoint (latest: {recent[-1]['latest'] or 'none'}; "
            f"{history_file}): not restarting; read the incidents in {run_dir / 'incidents'}, then resubmit "
            "(watch.max_restarts_without_progress)"
        )
