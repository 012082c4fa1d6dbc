"""The node's watcher: a process beside the ranks (started by `nanotron.launch.torchrun`), so a rank that holds the
GIL, is stopped or is stuck in native code is still seen.

    python -m nanotron watcher --dir WATCH_DIR --launcher PID   (`nanotron.commands.watcher`)

Every half second it reads each local rank's slot. A rank that stays in one phase longer than that phase's
limit is a hang: the limit is `watch.factor` x the longest time any rank of the node has spent in that phase so
far (at least `watch.floor_seconds`), `watch.unseen_phase_seconds` for a phase not seen yet (the first
checkpoint or evaluation), and `watch.startup_seconds` before the first step. Then it gathers evidence
(stacks through SIGUSR2, flight recorders, process states) into `<run dir>/incidents/<time>/`, prints one
line naming the culprit, writes the suspect nodes to `<run dir>/suspect_nodes.txt`, ends the local ranks and
leaves a verdict for the launcher, which exits with `NodeFaultError.exit_code`.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from nanotron.errors import NodeFaultError
from nanotron.io import write_atomic
from nanotron.watch.attribution import RankEvidence, Verdict, attribute
from nanotron.watch.heartbeat import (
    STACK_SIGNAL,
    flight_path,
    info_path,
    read_slot,
    request_dump,
    slot_path,
    stacks_path,
)
from nanotron.watch.nodes import Coordinator, node_name
from nanotron.watch.suspects import write_suspects

POLL_SECONDS = 0.5
DUMP_WAIT_SECONDS = 5.0
VERDICT = "verdict.json"
HANDLING = "handling"  # an incident is under way: a launcher whose ranks fail now waits for the verdict


class Limits:
    """Per-phase time limits learnt from the longest time any rank of the node has spent in each phase."""

    def __init__(self, settings: dict):
        self.settings, self.longest = settings, {}

    def learn(self, longest: dict[str, float]) -> None:
        for phase, seconds in longest.items():
            if seconds > 0 and phase not in ("startup", "done"):
                self.longest[phase] = max(self.longest.get(phase, 0.0), seconds)

    def limit(self, phase: str) -> float:
        s = self.settings
        if phase == "startup":
            return s["startup_seconds"]
        if phase not in self.longest:
            return s["unseen_phase_seconds"]
        return max(s["floor_seconds"], s["factor"] * self.longest[phase])


class Rank:
    """The watcher's view of one local rank."""

    def __init__(self, folder: Path, rank: int):
        self.rank, self.info = rank, json.loads(info_path(folder, rank).read_text())
        with open(slot_path(folder, rank), "r+b") as f:
            self.slot = mmap.mmap(f.fileno(), 0)
        self.state = read_slot(self.slot)

    def poll(self, limits: Limits) -> None:
        self.state = read_slot(self.slot)
        limits.learn(self.state["longest"])

    def process_state(self) -> str:
        """The kernel's one-letter state (R, S, D, T = stopped, ...), or "gone"."""
        try:
            return Path(f"/proc/{self.info['pid']}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return "gone"


def discover(folder: Path, known: dict[int, Rank]) -> None:
    for info in folder.glob("rank-*.json"):
        rank = int(info.stem.removeprefix("rank-"))
        if rank not in known and slot_path(folder, rank).exists():
            known[rank] = Rank(folder, rank)


def gather(folder: Path, ranks: dict[int, Rank], now: float) -> tuple[list[RankEvidence], dict[int, str]]:
    """What every local rank is doing: process state, flight recorder (if it answers) and all-thread stacks (from
    faulthandler in the rank, which works while it holds the GIL; from py-spy, if installed, when it is stopped)."""
    requests, offsets = {}, {}
    for rank in ranks.values():
        offsets[rank.rank] = _size(stacks_path(folder, rank.rank))
        if rank.process_state() != "gone":
            os.kill(rank.info["pid"], STACK_SIGNAL)
        requests[rank.rank] = request_dump(rank.slot)
    deadline = time.time() + DUMP_WAIT_SECONDS
    while time.time() < deadline and any(read_slot(r.slot)["dump_done"] < requests[r.rank] for r in ranks.values()):
        time.sleep(0.1)
    evidence, stacks = [], {}
    for rank in ranks.values():
        answered = read_slot(rank.slot)["dump_done"] >= requests[rank.rank]
        groups = json.loads(flight_path(folder, rank.rank).read_text())["groups"] if answered else None
        stopped = rank.process_state() == "T"
        state = rank.state
        evidence.append(
            RankEvidence(
                rank.rank, rank.info["node"], state["phase"], state["step"], now - state["since"], stopped, groups
            )
        )
        with open(stacks_path(folder, rank.rank), errors="replace") as f:
            f.seek(offsets[rank.rank])
            stacks[rank.rank] = f.read().strip() or _py_spy(rank.info["pid"])
    return evidence, stacks


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _py_spy(pid: int) -> str:
    """A stopped process runs no signal handler: py-spy reads its stacks from outside (without resuming it)."""
    tool = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if tool is None:
        return "(no stack: the process ran no signal handler, and py-spy is not installed to read it from outside)"
    try:
        done = subprocess.run([tool, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"(no stack: py-spy failed: {error})"
    return (done.stdout or done.stderr).decode(errors="replace").strip()


def write_incident(
    incident: Path,
    verdict: Verdict,
    evidence: list[RankEvidence],
    stacks: dict[int, str],
    limits: Limits,
    summary: bool,
) -> Path:
    """This node's ranks' stacks; with `summary` (the leading node) the verdict and every node's evidence too."""
    incident.mkdir(parents=True, exist_ok=True)
    for rank, text in stacks.items():
        (incident / f"rank-{rank}.stacks.txt").write_text(text + "\n")
    if not summary:
        return incident
    rows = [asdict(e) for e in sorted(evidence, key=lambda e: e.rank)]
    record = {"line": verdict.line, "culprits": verdict.culprits, "waiting": verdict.waiting, "ranks": rows}
    record["limits"] = {phase: limits.limit(phase) for phase in ("startup", *limits.longest)}
    (incident / "incident.json").write_text(json.dumps(record, indent=1))
    lines = [verdict.line, "", "rank  node  phase  step  stalled_s  state"]
    lines += [
        f"{e.rank}  {e.node}  {e.phase}  {e.step}  {e.stalled_seconds:.1f}  "
        + ("stopped" if e.stopped else "silent" if e.groups is None else "answered")
        for e in sorted(evidence, key=lambda e: e.rank)
    ]
    (incident / "summary.txt").write_text("\n".join(lines) + "\n")
    return incident


def act(folder: Path, ranks: dict[int, Rank], verdict: Verdict) -> None:
    """Leaves the verdict for the launcher and ends the node's ranks: the launch then exits with code 75, or
    restarts them in place (watch.on_hang)."""
    info = next(iter(ranks.values())).info
    decision = {"exit_code": NodeFaultError.exit_code, "line": verdict.line, "action": info["watch"]["on_hang"]}
    decision |= {"run_dir": info["run_dir"], "checkpoint_dir": info["checkpoint_dir"]}
    decision["limit"] = info["watch"]["max_restarts_without_progress"]
    write_atomic(folder / VERDICT, json.dumps(decision))
    for rank in ranks.values():
        try:
            os.kill(rank.info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def handle(
    folder: Path, ranks: dict[int, Rank], limits: Limits, coordinator: Coordinator | None, announced: str | None
):
    """One incident: this node's evidence, one verdict for the job (the leading node's), and the action."""
    (folder / HANDLING).touch()  # before any node can act: every node's evidence is in before the verdict
    now = time.time()
    evidence, stacks = gather(folder, ranks, now)
    run_dir = Path(next(iter(ranks.values())).info["run_dir"])
    incident = announced or f"{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}-{node_name()}"
    lead, everyone = True, evidence
    if coordinator is not None:
        incident, lead = coordinator.announce(incident)
        coordinator.publish(incident, evidence)
        everyone = coordinator.collect(incident) if lead else evidence
    verdict = attribute(everyone)
    nodes = sorted({e.node for e in everyone if e.rank in verdict.culprits})
    if coordinator is not None:
        if lead:
            coordinator.decide(incident, verdict, nodes)
        elif (decided := coordinator.verdict(incident)) is not None:
            verdict, nodes = Verdict(decided["line"], decided["culprits"]), decided["nodes"]
    directory = write_incident(run_dir / "incidents" / incident, verdict, everyone, stacks, limits, summary=lead)
    if lead:
        write_suspects(run_dir, nodes)
        print(verdict.line, file=sys.stderr, flush=True)
        print(f"incident: {directory} (stacks and flight recorders of every rank)", file=sys.stderr, flush=True)
    act(folder, ranks, verdict)


def watch(folder: Path, launcher: int, coordinator: Coordinator | None = None) -> int:
    ranks: dict[int, Rank] = {}
    limits: Limits | None = None
    while _alive(launcher):
        time.sleep(POLL_SECONDS)
        discover(folder, ranks)
        if not ranks:
            continue
        limits = limits or Limits(next(iter(ranks.values())).info["watch"])
        now = time.time()
        for rank in ranks.values():
            rank.poll(limits)
        stalled = [
            r
            for r in ranks.values()
            if r.state["phase"] != "done" and now - r.state["since"] > limits.limit(r.state["phase"])
        ]
        announced = coordinator.announced() if coordinator is not None else None
        if stalled or announced:
            handle(folder, ranks, limits, coordinator, announced)
            return 0
    shutil.rmtree(folder, ignore_errors=True)  # the launcher is gone (a SIGKILL): nobody else removes it
    return 0


def _alive(launcher: int) -> bool:
    """Whether the launcher still runs: a killed one is a zombie until its parent reaps it (os.kill(pid, 0) still
    succeeds), but this watcher, its child, has been handed to another parent by then."""
    return os.getppid() == launcher
