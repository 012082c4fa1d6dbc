"""Stop signals: the trainer owns them, its data workers ignore them, and no worker outlives its launcher.

SIGUSR1 (Slurm's `--signal`, the "checkpoint now" of a preemption), SIGTERM (`scancel`, `timeout`, a time
limit, `kill`) and a first SIGINT (Ctrl-C) ask the trainer to stop at the next step boundary, save and exit
0; all ranks agree on the stop in the step's one small collective. A second SIGINT aborts at once (exit
130). DataLoader workers share the trainer's process group, so a signal sent to the group reaches them
too: they ignore it, and end when the trainer closes the loader (or dies).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
ABORT_EXIT_CODE = 130  # 128 + SIGINT, what shells report for an interrupted command
_PR_SET_PDEATHSIG = 1
LAUNCHER_PID_VARIABLE = "NANOTRON_LAUNCHER_PID"  # set by nanotron.launch.torchrun for its workers


class StopRequest:
    """Traps the stop signals in this process; `requested` turns true at the first one."""

    def __init__(self) -> None:
        self.requested = False
        self.interrupts = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def close(self) -> None:
        """Gives the signals back to whoever had them (an in-process caller, e.g. a test runner)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                print("interrupted again: aborting without a checkpoint", file=sys.stderr, flush=True)
                os._exit(ABORT_EXIT_CODE)
            print(
                "interrupt: stopping at the next step boundary with a checkpoint (interrupt again to abort)",
                file=sys.stderr,
                flush=True,
            )
        self.requested = True


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: the trainer handles stops; a worker killed by one would crash it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def fail_writes_past_the_size_limit() -> None:
    """A write past the file-size limit (`ulimit -f`) sends SIGXFSZ, whose default action kills the process (a core
    dump, not a word, mid-save): ignored, the write fails with EFBIG, which the save names in one line with the last
    checkpoint kept. CPython ignores it at start-up already; set here so that an embedding host or a library that
    restored the default cannot undo that."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def stop_with_launcher() -> None:
    """Under a launcher (torchrun, nanotron.launch.torchrun), have the kernel send SIGTERM when it dies: a
    SIGKILLed launcher then leaves no orphaned workers training and writing checkpoints (they save and stop).

    Workers run in sessions of their own, so nothing else would reach them. Linux only (prctl).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    die_with_parent(signal.SIGTERM)
    launcher = os.environ.get(LAUNCHER_PID_VARIABLE)
    if os.getppid() == 1 or (launcher and str(os.getppid()) != launcher):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent(signum: int) -> bool:
    """Asks the kernel to send `signum` to this process when its parent dies (Linux's PR_SET_PDEATHSIG); False
    where that is not available. The parent may have died already: callers check `os.getppid()` after."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum) == 0
    except (OSError, AttributeError):
        return False
