"""Starting workers on this machine: torchrun in-process, with the exit code and signals a job needs.

    nanotron torchrun [torchrun options] -m nanotron.train --config ...   (`nanotron.commands.torchrun`)

is `torchrun` with two differences: when workers fail on bad input (exit code 2; 3: diverged; 4: a spike)
it exits with that code and prints nothing more than the workers' own one-line errors, and the stop signals
(SIGUSR1, Slurm's "checkpoint now", which would kill torchrun itself; SIGTERM and SIGINT, on which torchrun
would kill its workers after 30 s and exit 1) are handed to the workers, which save and exit 0, and so does
the launch.
`python -m nanotron.train --nproc_per_node N ...` uses it after validating the config.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from nanotron.console import say
from nanotron.errors import (
    ConfigError,
    DivergenceError,
    NodeFaultError,
    SpikeError,
    UserError,
    incident_dir,
    short,
)
from nanotron.signals import ABORT_EXIT_CODE, LAUNCHER_PID_VARIABLE, STOP_SIGNALS
from nanotron.watch.faults import ATTEMPT_VARIABLE
from nanotron.watch.heartbeat import WATCH_DIR_VARIABLE, fatal_path, info_path, read_slot, slot_path
from nanotron.watch.nodes import node_name
from nanotron.watch.suspects import record_fault
from nanotron.watch.watcher import HANDLING, VERDICT

QUIET_EXIT_CODES = {
    UserError.exit_code,
    DivergenceError.exit_code,
    SpikeError.exit_code,
    NodeFaultError.exit_code,
    ABORT_EXIT_CODE,
}


def pop_nproc(argv: list[str]) -> int:
    """Removes `--nproc_per_node N` (or `=N`) from argv and returns N (0 when absent); given twice, one line."""
    found = _pop_nproc_once(argv)
    again = _pop_nproc_once(argv) if found else 0
    if again:
        raise ConfigError(f"--nproc_per_node: given twice ({found}, then {again}); give it once")
    return found


def _pop_nproc_once(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--nproc_per_node" or arg.startswith("--nproc_per_node="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + (1 if "=" in arg else 2)]
            if not (value.isascii() and value.isdigit()) or int(value) < 1:
                raise ConfigError(f"--nproc_per_node: expected a positive integer, got {value!r}")
            return int(value)
    return 0


def launched_world_size() -> int:
    """World size from the launcher's environment (torchrun, srun) without touching the network."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def spawn_local(nproc: int, command: list[str]) -> int:
    """`command` (e.g. ["-m", "nanotron.train", ...]) in `nproc` processes on this machine."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_torchrun(["--standalone", f"--nproc_per_node={nproc}", *command])


def run_torchrun(args: list[str]) -> int:
    """torchrun's main with the exit code of the first failed worker, the stop signals forwarded to workers, and
    the node's watcher process beside them: its verdict on a hang decides the exit code, or (watch.on_hang =
    "restart") restarts the ranks in place until restarts stop bringing new checkpoints."""
    from torch.distributed.run import parse_args

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures are reported below
    # torchrun's own handlers would replace ours when it starts the workers: leave it the other signals only.
    config = parse_args(["--signals-to-handle=SIGHUP,SIGQUIT", *args])
    check_torchrun_args(config)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _forward_to_workers)
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())  # workers stop when this process dies
    for attempt in itertools.count():
        os.environ[ATTEMPT_VARIABLE] = str(attempt)
        code, verdict = _run_once(config)
        if verdict is None or verdict["action"] != "restart":
            return code
        try:
            record_fault(Path(verdict["run_dir"]), Path(verdict["checkpoint_dir"]), verdict["limit"], action="restart")
        except UserError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return error.exit_code
        say(f"restarting the ranks in place (attempt {attempt + 1}) after: {verdict['line']}")


def check_torchrun_args(config: argparse.Namespace) -> None:
    """One line each, before anything starts, for the flags torchrun raises a traceback for (an AssertionError for
    --nproc_per_node 0 or --nnodes 2:1) and for a missing script (every worker failed on it)."""
    from torch.distributed.run import determine_local_world_size

    nodes = config.nnodes.split(":")
    if len(nodes) > 2 or not all(n.isascii() and n.isdigit() for n in nodes) or not 0 < int(nodes[0]) <= int(nodes[-1]):
        raise ConfigError(f"--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got {config.nnodes!r}")
    try:
        nproc = determine_local_world_size(config.nproc_per_node)  # torchrun's reading: a number, auto, cpu, gpu
    except ValueError:  # anything else, or gpu without one
        nproc = 0
    if nproc < 1:
        raise ConfigError(
            "--nproc_per_node: expected a positive integer, or auto, cpu or gpu (where there are GPUs), got "
            f"{config.nproc_per_node!r}"
        )
    if config.max_restarts < 0:
        raise ConfigError(f"--max_restarts: expected an integer >= 0, got {config.max_restarts}")
    if not 0 < config.monitor_interval < float("inf"):
        raise ConfigError(f"--monitor_interval: expected a positive number of seconds, got {config.monitor_interval}")
    script = config.training_script
    if not (config.module or config.no_python or Path(script).is_file()):
        raise ConfigError(
            f"training_script '{script}': no such file; give a Python script, or -m MODULE (-m nanotron.train)"
        )
    if config.log_dir:
        try:
            os.makedirs(config.log_dir, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"--log_dir '{config.log_dir}': cannot make it ({error.strerror})") from None
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import config_from_args

    try:  # the rest of torchrun's reading of its flags (--rdzv_conf, --tee, ...), whose own messages are clear
        config_from_args(argparse.Namespace(**{**vars(config), "log_dir": os.devnull}))  # devnull: no log dir made
        parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
    except ValueError as error:
        raise ConfigError(f"torchrun: {error}") from None


def _run_once(config: argparse.Namespace) -> tuple[int, dict | None]:
    """One torchrun launch: (exit code, the watcher's verdict if it ended the ranks)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.run import run

    with _watcher(config) as (watch_dir, watcher):
        try:
            run(config)
        except (ChildFailedError, RendezvousConnectionError) as error:  # torchrun has stopped this node's ranks
            # this node's watcher ended them and printed why; or another node's acted first, and they lost their peers
            # (or torchrun the store that node's launcher hosted) while this one's was still writing the same verdict
            if (verdict := watcher.verdict(watch_dir)) is not None:
                return verdict["exit_code"], verdict
            if isinstance(error, RendezvousConnectionError):
                message = (
                    f"error: lost the rendezvous store (--rdzv_endpoint {config.rdzv_endpoint}): its node's launcher "
                    "ended or the node is unreachable (or its port is blocked, at start); this node's ranks were "
                    f"stopped ({short(error.__cause__ or error)})"
                )
                print(message, file=sys.stderr, flush=True)
                return 1, None
            quiet = sorted((rank, f.exitcode) for rank, f in error.failures.items() if f.exitcode in QUIET_EXIT_CODES)
            if quiet:  # a worker has printed its one-line error (the others were ended by torchrun)
                return quiet[0][1], None
            if (died := _report_death(error, watch_dir)) is not None:  # a rank killed by a signal: named in one line
                return died, None
            print(error.format_msg(), file=sys.stderr, flush=True)
            return 1, None
    return 0, None


def _report_death(error, watch_dir: Path) -> int | None:
    """When a worker was killed by a signal (SIGKILL by the OOM killer or by hand, a segfault; not the SIGTERM with
    which torchrun ends the others): one line naming its rank, node, signal, the step its heartbeat last showed and,
    for a fatal signal, the Python line it died in; torchrun's table, that rank's stacks and the other ranks'
    tracebacks (they only lost their peer) go to `<run dir>/incidents/launch-<pid>-<attempt>/`. Exit code 1.
    (torchrun's own "first failure" compares whole seconds and picks the lowest rank on a tie, which is usually a
    survivor.)"""
    killed = sorted(
        (f.timestamp, rank, f)
        for rank, f in error.failures.items()
        if f.exitcode is not None and f.exitcode < 0 and -f.exitcode != signal.SIGTERM
    )
    if not killed:
        return None
    _, rank, failure = killed[0]
    name = _signal_name(-failure.exitcode)
    where = _last_heartbeat(watch_dir, rank)
    node = where.get("node") or node_name()
    line = f"rank {rank} (node {node}) died: killed by signal {-failure.exitcode} ({name})"
    line += f" at step {where['step']} ({where['phase']})" if "step" in where else ""
    stacks = ""
    with contextlib.suppress(OSError):
        stacks = fatal_path(watch_dir, rank).read_text(errors="replace")  # the watch dir goes with the launcher
    line += crash_site(stacks)
    folder = incident_dir(where.get("run_dir")) if where.get("run_dir") else None
    if folder is not None:
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "summary.txt").write_text(line + "\n\n" + error.format_msg() + "\n")
            if stacks:
                (folder / f"rank-{rank}.fatal.txt").write_text(stacks)
            line += f"; details in {folder}"
    print(line, file=sys.stderr, flush=True)
    return 1


def crash_site(stacks: str) -> str:
    """Where `faulthandler`'s dump (threads most recent first, each `  File "PATH", line N in FUNCTION`, innermost
    frame first) says the rank died, as " in PATH:N (FUNCTION)" for the thread that took the signal, or, when that
    was a C++ thread (gloo's or NCCL's own: no Python frame to show), " while the main thread was in ..." (the main
    thread is listed last); "" without a Python frame. PATH is shortened to what follows site-packages/ (the
    standard library's lib/python3.X/) or the working directory."""
    blocks = re.split(r"\n(?=Current thread |Thread )", stacks)
    current = [b for b in blocks if b.startswith("Current thread ")]
    threads = [b for b in blocks if b.startswith("Thread ")]
    if current:
        block, words = current[0], " in"
    else:
        block, words = (threads[-1] if threads else ""), " while the main thread was in"
    match = re.search(r'^\s*File "(.*)", line (\d+) in (.*)$', block, re.MULTILINE)
    if match is None:
        return ""
    path, number, function = match.groups()
    path = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", path)  # torch/..., threading.py
    with contextlib.suppress(ValueError):
        path = str(Path(path).relative_to(Path.cwd()))
    return f"{words} {path}:{number} ({function})"


def _last_heartbeat(watch_dir: Path, rank: int) -> dict:
    """The rank's node and run dir (its info file) and last step and phase (its slot), as far as they exist."""
    where: dict = {}
    with contextlib.suppress(OSError, ValueError):
        where |= json.loads(info_path(watch_dir, rank).read_text())
    with contextlib.suppress(OSError, ValueError, struct.error):
        slot = read_slot(slot_path(watch_dir, rank).read_bytes())
        where |= {"step": slot["step"], "phase": slot["phase"]}
    return where


@contextlib.contextmanager
def _watcher(config: argparse.Namespace) -> Iterator[tuple[Path, KeptWatcher]]:
    """The node's watcher process (nanotron.watch.watcher) and the node-local folder of the ranks' slots; with
    several nodes, the watchers meet in the rendezvous endpoint's key-value store."""
    with tempfile.TemporaryDirectory(prefix="nanotron-watch-") as folder:
        os.environ[WATCH_DIR_VARIABLE] = folder
        command = [sys.executable, "-m", "nanotron", "watcher", "--dir", folder, "--launcher", str(os.getpid())]
        nnodes = int(str(config.nnodes).rpartition(":")[2])
        if nnodes > 1 and config.rdzv_endpoint and not config.standalone:
            command += ["--nnodes", str(nnodes), "--store", config.rdzv_endpoint]
        watcher = KeptWatcher(command)
        try:
            yield Path(folder), watcher
        finally:
            watcher.stop()


VERDICT_PATIENCE_SECONDS = 60.0  # srun --wait (launch/slurm.sh) ends a node 60 s after the first one


class KeptWatcher:
    """The watcher process, started again when a signal kills it (kill -9, the OOM killer): the new one reads the
    same slots, where the ranks keep their phases, times and learnt limits, so it picks up where the other left
    off. A thread of the launcher waits on it: one blocked waitpid per node, nothing on the ranks or their steps.
    A watcher that exits by itself is not started again: with 0 after its verdict, else after a crash's traceback,
    with one line saying that the node is unwatched from then on."""

    def __init__(self, command: list[str]):
        self.command, self.stopping, self.lock = command, False, threading.Lock()
        self.process = self._start()
        threading.Thread(target=self._keep, name="nanotron-watcher-keeper", daemon=True).start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self.command, start_new_session=True)  # signals to the launch's group pass it by

    def _keep(self) -> None:
        while (code := (dead := self.process).wait()) < 0:
            with self.lock:
                if self.stopping:
                    return
                self.process = self._start()
            say(
                f"warning: the node's watcher (pid {dead.pid}) was killed by signal {-code} ({_signal_name(-code)}); "
                f"restarted it (pid {self.process.pid}) on the same ranks, hangs are still watched"
            )
        if code > 0 and not self.stopping:
            say(
                f"warning: the node's watcher (pid {dead.pid}) failed (exit code {code}); its ranks are unwatched "
                "from now on: a hang ends at distributed.timeout_minutes"
            )

    def verdict(self, folder: Path, patience: float = VERDICT_PATIENCE_SECONDS) -> dict | None:
        """The verdict the watcher left in its folder, if it ended the ranks. On several nodes a peer node's watcher
        may act first: our ranks, blocked in a collective with the ranks it ended, fail by themselves (exit code 1),
        or torchrun loses the rendezvous store that node's launcher hosted, while our watcher still writes the same
        verdict. So while it handles an incident, wait for the verdict (seconds: the ranks' stacks, the leader's
        gathering; at most `patience`)."""
        path, deadline = folder / VERDICT, time.monotonic() + patience
        while not path.exists() and (folder / HANDLING).exists() and time.monotonic() < deadline:
            if self.process.poll() is not None:  # it ended without one: a crash, whose traceback is printed
                break
            time.sleep(0.1)
        return json.loads(path.read_text()) if path.exists() else None

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.process.kill()  # it ignores the stop signals, which are the ranks' to act on
        self.process.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unknown signal"


def _forward_to_workers(signum: int, frame: object) -> None:
    """The workers run in their own sessions, so a signal to this process (Ctrl-C at a terminal, `kill`,
    `timeout`) reaches them only through here: hand it to the workers (our children), which checkpoint and
    exit 0, and so does torchrun."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if stat.read_text().rpartition(")")[2].split()[1] == me:
                os.kill(int(stat.parent.name), signum)
