"""Each rank says where it is: a 112-byte slot in a node-local file that the node's watcher process reads.

Writing a phase is a few stores into shared memory (no collective, no system call, no host sync), so it costs
nothing measurable per step. The slot also carries the watcher's requests: a rank dumps its flight recorder's
last collective per process group from a small thread (which runs while the main thread waits in a collective),
and all-thread stacks come from `faulthandler` on SIGUSR2, which is written from the signal handler itself and
so works even while the main thread holds the GIL. A rank that is stopped or holds the GIL answers neither:
the watcher, another process, still sees it.
"""

from __future__ import annotations

import faulthandler
import json
import mmap
import os
import signal
import struct
import threading
import time
from pathlib import Path

from nanotron.io import write_atomic
from nanotron.watch.nodes import node_name

WATCH_DIR_VARIABLE = "NANOTRON_WATCH_DIR"  # set by nanotron.launch.torchrun for its workers: a node-local folder
PHASES = ("startup", "data", "forward", "backward", "optimizer", "checkpoint", "eval", "done")
STACK_SIGNAL = signal.SIGUSR2
# version, phase, step, phase start (time.time()), write counter (odd while writing), dump request, dump done,
# then the longest time this rank has spent in each phase (what the watcher's limits are learnt from)
SLOT = struct.Struct(f"<iiqdqqq{len(PHASES)}d")
_COUNTER_OFFSET = struct.calcsize("<iiqd")
_REQUEST_OFFSET = _COUNTER_OFFSET + 8
_LONGEST_OFFSET = _REQUEST_OFFSET + 16
_VERSION = 1


def slot_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.slot"


def info_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.json"


def stacks_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.stacks.txt"


def fatal_path(folder: Path, rank: int) -> Path:
    """Written by `faulthandler` when the rank dies of SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL (else empty)."""
    return Path(folder) / f"rank-{rank}.fatal.txt"


def flight_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.flight.json"


class Heartbeat:
    """This rank's slot (None when no watcher runs: the phase calls then do nothing)."""

    def __init__(self, folder: Path | None, rank: int, info: dict):
        self.rank, self.step = rank, 0
        self.folder, self.slot, self._stacks = folder, None, None
        self.phase, self.since, self.longest = 0, time.time(), [0.0] * len(PHASES)
        if folder is None:
            return
        path = slot_path(folder, rank)
        with open(path, "wb") as f:
            f.write(bytes(SLOT.size))
        with open(path, "r+b") as f:
            self.slot = mmap.mmap(f.fileno(), SLOT.size)
        self._counter = 0
        self.beat("startup")
        write_atomic(info_path(folder, rank), json.dumps({**info, "pid": os.getpid(), "node": node_name()}))
        self._stacks = open(stacks_path(folder, rank), "w")  # noqa: SIM115 - faulthandler writes it until exit
        faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        # Until the process ends (a teardown can crash too); the signal then kills it as before (exit code -N).
        faulthandler.enable(file=open(fatal_path(folder, rank), "w"), all_threads=True)  # noqa: SIM115
        threading.Thread(target=self._serve_dumps, name="nanotron-heartbeat", daemon=True).start()

    @classmethod
    def from_env(cls, rank: int, info: dict, enabled: bool = True) -> Heartbeat:
        folder = os.environ.get(WATCH_DIR_VARIABLE)
        return cls(Path(folder) if folder and enabled else None, rank, info)

    def beat(self, phase: str, step: int | None = None) -> None:
        """Enters `phase` (of step `step`, or the current one)."""
        if step is not None:
            self.step = step
        if self.slot is not None:
            now = time.time()
            if now - self.since > self.longest[self.phase]:
                self.longest[self.phase] = now - self.since
                struct.pack_into("<d", self.slot, _LONGEST_OFFSET + 8 * self.phase, now - self.since)
            self.phase, self.since = PHASES.index(phase), now
            self._counter += 1  # odd: a reader retries
            struct.pack_into("<q", self.slot, _COUNTER_OFFSET, self._counter)
            struct.pack_into("<iiqd", self.slot, 0, _VERSION, self.phase, self.step, now)
            self._counter += 1
            struct.pack_into("<q", self.slot, _COUNTER_OFFSET, self._counter)

    def close(self) -> None:
        if self.slot is not None:
            self.beat("done")
            faulthandler.unregister(STACK_SIGNAL)
            self._stacks.close()

    def _serve_dumps(self) -> None:
        """Answers the watcher's flight-recorder requests; runs whenever the main thread is not holding the GIL,
        which is the case while it waits in a collective."""
        done = 0
        while True:
            time.sleep(0.2)
            request = struct.unpack_from("<q", self.slot, _REQUEST_OFFSET)[0]
            if request > done:
                write_atomic(flight_path(self.folder, self.rank), json.dumps(last_collectives()), durable=False)
                done = request
                struct.pack_into("<q", self.slot, _REQUEST_OFFSET + 8, done)


def read_slot(slot: mmap.mmap | bytes) -> dict:
    """One consistent read of a slot (retried while its rank is writing it)."""
    for _ in range(100):
        version, phase, step, started, counter, request, done, *longest = SLOT.unpack_from(slot, 0)
        if counter % 2 == 0 and struct.unpack_from("<q", slot, _COUNTER_OFFSET)[0] == counter:
            break
    return {
        "version": version,
        "phase": PHASES[phase] if 0 <= phase < len(PHASES) else "?",
        "step": step,
        "since": started,
        "beats": counter,
        "dump_request": request,
        "dump_done": done,
        "longest": dict(zip(PHASES, longest)),
    }


def request_dump(slot: mmap.mmap) -> int:
    """Asks the slot's rank for a flight-recorder dump; returns the request number to wait for."""
    request = struct.unpack_from("<q", slot, _REQUEST_OFFSET)[0] + 1
    struct.pack_into("<q", slot, _REQUEST_OFFSET, request)
    return request


def last_collectives(recent: int = 16) -> dict:
    """For each process group this rank used: its description, the sequence numbers of the last collective it
    enqueued and the last one that completed (a rank blocked in a collective has enqueued > completed), and the
    `recent` last collectives as [seq, op, input sizes], from torch's flight recorder. On gloo the entries' state
    stays `scheduled` whether done or not: the sequence numbers are what tell."""
    from nanotron.parallel.torch_private import flight_recorder_trace

    trace = flight_recorder_trace()
    status = trace.get("pg_status", {})
    groups: dict[str, dict] = {}
    for entry in trace.get("entries", []):
        if entry.get("is_p2p"):
            continue
        name, desc = entry["process_group"]
        group = groups.setdefault(name, {"desc": desc, "recent": []})
        group["recent"] = [
            *group["recent"][-(recent - 1) :],
            [entry["collective_seq_id"], entry["profiling_name"].rpartition(":")[2], entry["input_sizes"]],
        ]
        group |= {
            "seq": entry["collective_seq_id"],
            "op": entry["profiling_name"].rpartition(":")[2],
            "created_ns": entry["time_created_ns"],
            "record": entry["record_id"],
            "enqueued": status.get(name, {}).get("last_enqueued_collective", entry["collective_seq_id"]),
            "completed": status.get(name, {}).get("last_completed_collective", -1),
        }
    return {"groups": groups}
