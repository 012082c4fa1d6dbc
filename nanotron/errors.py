"""User-facing errors and the one boundary every command line goes through.

A `UserError` is bad input: its message names the key, flag or file, what was expected and a fix. The
boundary (`run_command`) prints it as one `error: ...` line and returns exit code 2. Under a distributed
launch the rank that met the error prints it, tagged `[rank N]`, and each distinct message is printed once
however many ranks meet it (they agree through the launcher's key-value store); ranks that then fail only
because a peer went away stay quiet and exit with the first failure's code.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import resource
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from nanotron.signals import LAUNCHER_PID_VARIABLE

FAILED_KEY = "nanotron/failed"


class UserError(Exception):
    """Bad input from the user: a message that names the key or file, what was expected, and a fix."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, override or flag is wrong."""


class DataError(UserError):
    """A dataset or tokenizer can't be found or used."""


class CheckpointError(UserError):
    """A checkpoint can't be written, found or loaded."""


class DivergenceError(UserError):
    """Training diverged (non-finite loss or gradients): nothing was saved past the last good checkpoint."""

    exit_code = 3


class SpikeError(UserError):
    """A loss spike the stability policy stops at (action = "stop", or rollbacks exhausted): the checkpoints before
    it are intact; a person decides (lower the learning rate, skip more data, resume)."""

    exit_code = 4


class NodeFaultError(UserError):
    """A node stalls or slows the job (named by the watcher or the straggler scores, in suspect_nodes.txt of the
    run dir): the job stops so that it can be requeued without that node. `nodes`: the ones to leave out."""

    exit_code = 75

    def __init__(self, message: str, nodes: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.nodes = list(nodes)


class LaunchError(UserError):
    """A job can't be started (no Slurm here, sbatch refused it, a worker failed)."""


class StorageError(UserError):
    """The file system refused a write (read-only, full, over quota, permissions), or an output path can't be one."""


# What a file system says that a person fixes (space, quota, permissions, a read-only or failing mount). Anything
# else (a path that should exist and doesn't, a bad argument) is a bug: it stays a traceback.
STORAGE_ERRNOS = {
    errno.EROFS,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EFBIG,
    errno.EIO,
    errno.ESTALE,
}


@contextlib.contextmanager
def storage_errors(action: str, path: object, hint: str = ""):
    """One line for a file-system failure while `action` (e.g. "commit checkpoint") on `path`: the file and the
    OS error (`No space left on device`, `Read-only file system`), and `hint`."""
    try:
        yield
    except OSError as error:
        if error.errno not in STORAGE_ERRNOS:
            raise
        where = f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
        raise StorageError(
            f"cannot {action} '{path}'{where}: {os_reason(error)}" + (f"; {hint}" if hint else "")
        ) from None


def short(error: BaseException) -> str:
    """`Type: last line of the message`, for one-line errors."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1][:300]}" if text else type(error).__name__


def os_reason(error: OSError) -> str:
    """The OS's words for `error`; for EFBIG also the limit a person raises (it is per process, not the disk's)."""
    if error.errno == errno.EFBIG and (limit := file_size_limit()) is not None:
        return f"{error.strerror}, at this process's file-size limit of {limit} bytes: raise `ulimit -f`"
    return str(error.strerror or error)


def file_size_limit() -> int | None:
    """RLIMIT_FSIZE (`ulimit -f`) in bytes, None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def run_command(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Runs a command's `main(argv)` and returns its exit code; bad input becomes one line and code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return main(argv) or 0
    except UserError as error:
        _report(str(error), error.exit_code)
        return error.exit_code
    except Exception as error:
        first = _first_failure()
        if first is not None:  # a peer failed first and this rank only lost its connection: stay quiet
            return first
        if peer_lost(error) and (saved := save_peer_loss()) is not None:
            return saved  # a peer died without a word (a signal): the launcher names it; the traceback is on file
        _record_failure(1)
        raise


RUN_DIR_VARIABLE = "NANOTRON_RUN_DIR"  # set by `nanotron.train` for its own process once the config is resolved
LAUNCH_ATTEMPT_VARIABLE = "NANOTRON_LAUNCH_ATTEMPT"  # nanotron.watch.faults.ATTEMPT_VARIABLE (0, 1, ... restarts)
PEER_LOST_EXIT_CODE = 1
# What a collective says when the rank at the other end is gone (gloo; NCCL with async error handling).
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "remote process exited",
)


def peer_lost(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is a collective losing its peer."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(text in str(error) for text in _PEER_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


def incident_dir(run_dir: str | None = None) -> Path | None:
    """Where this launch's ranks and launcher keep the details of a rank's death: `<run dir>/incidents/
    launch-<launcher pid>-<attempt>/` (None without nanotron's launcher or a known run dir). `run_dir`: the
    launcher's (from a rank's heartbeat info); a rank's own comes from its environment."""
    run_dir, launcher = run_dir or os.environ.get(RUN_DIR_VARIABLE), os.environ.get(LAUNCHER_PID_VARIABLE)
    if not run_dir or not launcher:
        return None
    return Path(run_dir) / "incidents" / f"launch-{launcher}-{os.environ.get(LAUNCH_ATTEMPT_VARIABLE, '0')}"


def save_peer_loss() -> int | None:
    """Under nanotron's launcher: this rank's traceback to the incident folder, nothing on the console (the
    launcher prints one line naming the rank that died); the exit code, or None when it can't be filed."""
    folder = incident_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{os.environ.get('RANK', '0')}.traceback.txt").write_text(traceback.format_exc())
    except OSError:
        return None
    return PEER_LOST_EXIT_CODE


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _report(message: str, code: int) -> None:
    """Prints the error once per distinct message across all ranks of a distributed job."""
    if _world_size() == 1:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return
    store = _store()
    _record_failure(code, store)
    key = "nanotron/error/" + hashlib.sha256(message.encode()).hexdigest()[:32]
    first = store is None or _quiet(lambda: store.add(key, 1)) in (None, 1)
    if first:
        print(f"error: [rank {os.environ.get('RANK', '?')}] {message}", file=sys.stderr, flush=True)


@functools.cache
def _store():
    """A client of the launcher's key-value store (torchrun's, or rank 0's), or None when there is none."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if _world_size() == 1 or not addr or not port or not _listening(addr, port):
        return None
    from torch.distributed import TCPStore

    return _quiet(lambda: TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10)))


def _listening(addr: str, port: str) -> bool:
    """Whether anything accepts connections there. A store whose launcher died (SIGKILL, a lost node) refuses at
    once, where TCPStore's client would retry for twice its timeout and print pages of C++ stack per try."""
    try:
        socket.create_connection((addr, int(port)), timeout=2).close()
        return True
    except (OSError, ValueError):
        return False


def _quiet(action: Callable):
    try:
        return action()
    except Exception:  # the store is a courtesy: without it every rank prints its own line
        return None


def _record_failure(code: int, store=None) -> None:
    """Marks the job as failed (first failure wins) so peers that then lose their connection stay quiet."""
    store = store or _store()
    if store is not None:
        _quiet(lambda: store.compare_set(FAILED_KEY, "", str(code)))


def _first_failure() -> int | None:
    """The exit code of a failure another rank recorded before this one, if any."""
    store = _store()
    if store is None or not _quiet(lambda: store.check([FAILED_KEY])):
        return None
    value = _quiet(lambda: store.get(FAILED_KEY))
    return int(value) if value else None


def exit_process(code: int) -> None:
    """Ends the process now, after flushing: skips interpreter teardown, where gloo threads still holding
    work can abort with `terminate called without an active exception` (exit -6 after a good run), and where
    multiprocessing would wait forever for DataLoader workers that ignore SIGTERM. Never raises: a console
    that went away (a broken pipe) must not turn the exit into a teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing is left to report to
            pass
    os._exit(code)


def exit_status(exit_: SystemExit) -> int:
    """The status Python ends with for `sys.exit(code)`: 0 for None, the number, or 1 with the message printed."""
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    with contextlib.suppress(Exception):  # e.g. stderr is a broken pipe
        print(exit_.code, file=sys.stderr)
    return 1


def run_as_main(main: Callable[[], int]) -> None:
    """A gloo process's `if __name__ == "__main__":` body: `main()`, a traceback for a crash, then `exit_process`
    with its code whatever happened (never the interpreter's teardown)."""
    code = 1
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_status(exit_)
    except BaseException:
        with contextlib.suppress(Exception):  # e.g. stderr is a broken pipe
            traceback.print_exc()
    finally:
        exit_process(code)
