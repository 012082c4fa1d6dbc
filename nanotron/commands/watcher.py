"""`python -m nanotron watcher --dir WATCH_DIR --launcher PID [--nnodes N --store HOST:PORT]`: the node's watcher
process (`nanotron.watch.watcher`), started by `nanotron torchrun` beside the ranks; not for typing."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from nanotron.signals import STOP_SIGNALS
from nanotron.watch.nodes import Coordinator, node_name
from nanotron.watch.watcher import watch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanotron watcher", description=__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="the node-local folder of the ranks' slots")
    parser.add_argument("--launcher", type=int, required=True, help="pid of the launcher: stop when it is gone")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the job (each runs a watcher)")
    parser.add_argument("--store", default="", help="host:port of the launcher's key-value store (several nodes)")
    args = parser.parse_args(argv)
    for sig in STOP_SIGNALS:  # a stop is the ranks' to act on (the launcher hands it to its children, us included)
        signal.signal(sig, signal.SIG_IGN)
    coordinator = Coordinator(args.store, args.nnodes, node_name()) if args.nnodes > 1 and args.store else None
    return watch(args.dir, args.launcher, coordinator)
