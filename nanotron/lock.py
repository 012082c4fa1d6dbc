"""One run per run dir: a lock file naming its owner (host, pid, Slurm job), taken by global rank 0.

Two runs writing one run dir interleave metrics.jsonl, resume from each other's checkpoints and prune each
other's saves. The lock is a hard link to a fully written file (atomic, and it fails when the lock exists, on
local and NFS-style shared filesystems alike, unlike flock, which many cluster filesystems don't honour
across nodes). A lock whose owner is provably gone is taken over with a note: an earlier run of the same Slurm
job (a requeue: a higher SLURM_RESTART_COUNT, which Slurm starts only after the previous run ended, possibly on
another node); on this host, an owner from before the last reboot (another boot id), or in this pid namespace a
pid that has exited or now belongs to a process started at another time (a reused pid). An owner in another pid
namespace on this host (a container, `unshare --pid`) has a pid that means nothing here: undecidable, so refused,
naming the file to delete if it is gone. Anything else is refused too.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from nanotron.console import say
from nanotron.errors import ConfigError

LOCK_FILE = "run.lock"


def _owner() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        **process_identity(),
    }


def process_identity() -> dict:
    """What tells this process apart beyond its pid (Linux; empty values elsewhere): the host's boot, the pid
    namespace the pid belongs to, and the process's start time in clock ticks since boot."""
    return {
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _readlink("/proc/self/ns/pid"),
        "start_ticks": _start_ticks("self"),
    }


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _start_ticks(pid: int | str) -> int | None:
    """Field 22 of /proc/PID/stat (after the command name, which may hold spaces and parentheses)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _proc_shows_my_namespace() -> bool:
    """Whether /proc's pids are this pid namespace's (not so under `unshare --pid` without a new /proc)."""
    try:
        return int(Path("/proc/self/stat").read_text().split()[0]) == os.getpid()
    except (OSError, IndexError, ValueError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


OTHER_NAMESPACE = "another pid namespace"


def _stale_reason(owner: dict) -> str | None:
    """Why the lock's owner can no longer be writing (None: it may be, or it can't be told; see `_undecidable`)."""
    me = _owner()
    restart = owner.get("slurm_restart", 0)
    if (
        owner.get("slurm_job_id") == me["slurm_job_id"] != ""
        and isinstance(restart, int)
        and restart < me["slurm_restart"]
    ):
        return f"an earlier run of Slurm job {owner['slurm_job_id']} (requeued)"
    pid = owner.get("pid")
    if owner.get("host") != me["host"] or not isinstance(pid, int):
        return None
    boot = owner.get("boot_id")
    if boot and me["boot_id"] and boot != me["boot_id"]:
        return f"process {pid} on {owner['host']} from before the host rebooted"
    if _undecidable(owner, me):
        return None
    if not _alive(pid):
        return f"process {pid} on {owner['host']}, which has exited"
    started = owner.get("start_ticks")
    if isinstance(started, int) and _proc_shows_my_namespace() and _start_ticks(pid) not in (None, started):
        return f"process {pid} on {owner['host']}, which has exited (its pid was reused by another process)"
    return None


def _undecidable(owner: dict, me: dict) -> bool:
    """An owner on this host in another pid namespace: its pid can't be looked up from here. (A lock written
    before these fields existed has none: judged by its pid, as then.)"""
    return bool(owner.get("pid_ns")) and bool(me["pid_ns"]) and owner["pid_ns"] != me["pid_ns"]


class RunLock:
    """Held from start-up until the run ends; `release()` removes the file only if it is still ours."""

    def __init__(self, folder: Path, key: str = "job.name"):
        self.path = Path(folder) / LOCK_FILE
        self.key = key  # the option that chose the folder, named when it is refused
        self.owner = _owner()
        self.held = False

    def acquire(self) -> str | None:
        """Takes the lock, or raises ConfigError naming who holds it; returns a note when a stale one was taken."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = self.path.with_name(f"{LOCK_FILE}.{self.owner['host']}.{self.owner['pid']}")
        mine.write_text(json.dumps(self.owner))
        note = None
        try:
            for _ in range(5):  # a takeover races with at most a few other starters
                try:
                    os.link(mine, self.path)  # atomic, fails if the lock exists, and never shows a half-written one
                except FileExistsError:
                    owner = self._read(self.path)
                    if owner == {}:
                        continue  # released meanwhile
                    reason = "an unreadable lock file" if owner is None else _stale_reason(owner)
                    if reason is None:
                        raise ConfigError(self._refusal(owner)) from None
                    self._take_over(owner)
                    where = "run dir" if self.key == "job.name" else "checkpoint dir"
                    note = f"{where}: took over the lock of {reason} ({self.path})"
                    continue
                self.held = True
                return note
        finally:
            mine.unlink(missing_ok=True)
        raise ConfigError(f"{self.path}: other runs keep taking this run dir's lock; check who uses the run dir")

    def _take_over(self, stale_owner: dict | None) -> None:
        """Moves a stale lock aside; puts it back if another starter replaced it meanwhile with a live one."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale.{self.owner['pid']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if self._read(aside) != stale_owner:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)

    @staticmethod
    def _read(path: Path) -> dict | None:
        """The lock's owner; {} when there is no lock file any more, None when it is unreadable."""
        try:
            owner = json.loads(path.read_text(errors="replace"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def _refusal(self, owner: dict) -> str:
        who = f"pid {owner.get('pid')} on {owner.get('host')}"
        if owner.get("slurm_job_id"):
            who += f" (Slurm job {owner['slurm_job_id']})"
        since = f"({who}, since {owner.get('started', '?')})"
        gone = f"if it is gone and was on another host, delete {self.path}"
        if owner.get("host") == socket.gethostname() and _undecidable(owner, process_identity()):
            since = f"({who} in {OTHER_NAMESPACE} {owner['pid_ns']}, a container?, since {owner.get('started', '?')})"
            gone = f"whether it still runs can't be told from this namespace: if it is gone, delete {self.path}"
        if self.key == "checkpoint.dir":
            return (
                f"checkpoint.dir: {self.path.parent} is in use by another run {since}; each run needs its own "
                f"(it resumes from, overwrites and prunes what is there): point checkpoint.dir elsewhere, or stop "
                f"that run; {gone}"
            )
        return (
            f"job.name: the run dir {self.path.parent} is in use by another run {since}; pick another job.name "
            f"(or job.out_dir), or stop that run; {gone}"
        )

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Removes our lock file; a file system that refuses (read-only, gone) is one warning line, never an error
        that would hide the run's own outcome (the next run takes over a dead owner's lock)."""
        if not self.held:
            return
        self.held = False
        if self._read(self.path) == self.owner:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as error:
                print(f"warning: cannot remove the run lock '{self.path}' ({error.strerror})", file=sys.stderr)


def lock_run(folders: list[Path]) -> contextlib.ExitStack:
    """Locks the run dir and the checkpoint dir (`folders`, in that order), each under the same file name
    wherever it lives: a checkpoint dir inside a run dir is locked too, so another run pointing its
    checkpoint.dir at it, or at that run dir itself, finds a held lock. The stack releases them; a refusal
    releases the ones already taken."""
    keys = ("job.name", "checkpoint.dir")
    with contextlib.ExitStack() as taken:
        locked: list[Path] = []
        for folder, key in zip((Path(f).resolve() for f in folders), keys):
            if folder in locked:
                continue
            locked.append(folder)
            if note := taken.enter_context(RunLock(folder, key)).acquire():
                say(note)
        return taken.pop_all()
