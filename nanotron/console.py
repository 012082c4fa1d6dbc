"""The console every nanotron process writes its lines to: Python's `logging`, one timestamped line per message on
stdout (what people read in a Slurm log and grep), the same format for the trainer, the checkpoint manager and
the progress of long commands."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

FORMAT = "%(asctime)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _CurrentStdout(logging.StreamHandler):
    """Writes to sys.stdout as it is at each line: a redirect (or a test's capture) may have replaced it."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def console() -> logging.Logger:
    logger = logging.getLogger("nanotron")
    if not logger.handlers:
        handler = _CurrentStdout()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # a library user's root handlers would print every line twice
    return logger


def say(message: str) -> None:
    """One line on the console, timestamped."""
    console().info(message)


@contextlib.contextmanager
def quiet_handler_errors() -> Iterator[None]:
    """Within: a logging handler that fails to write (a library's own log file on a full disk) drops its record
    instead of printing `--- Logging error ---` and a stack for each one (W&B's debug log: 9,185 lines)."""
    previous, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        yield
    finally:
        logging.raiseExceptions = previous


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def format_count(count: float) -> str:
    """12,345 -> '12.3k', 1.6e9 -> '1.60B': token counts at a glance."""
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if count >= threshold:
            return f"{count / threshold:.{max(0, 3 - len(str(int(count // threshold))))}f}{suffix}"
    return f"{count:.0f}"
