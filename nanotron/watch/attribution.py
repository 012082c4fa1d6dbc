"""Who a hang is waiting for, from what every rank of the node said (or could not say) when it was detected.

Evidence per rank: its phase and step (heartbeat slot), whether its process is stopped (/proc), whether it
answered the flight-recorder request (a rank holding the GIL or stopped cannot), and the last collective it
enqueued on each process group. A rank blocked in collective #s of a group waits for the members whose last
sequence number on that group is below s; of the pending collectives, the oldest is the one the job waits on.
Sequence numbers, not entry states, decide: gloo's entries stay `scheduled` whether done or not.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RankEvidence:
    rank: int
    node: str
    phase: str
    step: int
    stalled_seconds: float
    stopped: bool = False
    groups: dict[str, dict] | None = None  # None: did not answer the flight-recorder request


@dataclass
class Verdict:
    line: str
    culprits: list[int]
    waiting: dict[str, list[int]] = field(default_factory=dict)  # "all_reduce #41 on the dp group" -> ranks


def group_label(desc: str) -> str:
    """DeviceMesh names its groups mesh_<dim>; the default group is the world."""
    if desc in ("default_pg", ""):
        return "world"
    return desc.removeprefix("mesh_")


def _pending(evidence: RankEvidence) -> tuple[str, dict] | None:
    """The collective this rank enqueued last (the one it is blocked in, if it is blocked in one)."""
    if not evidence.groups:
        return None
    return max(evidence.groups.items(), key=lambda item: item[1]["record"])


def _describe(group: str, entry: dict) -> str:
    return f"{entry['op']} #{entry['seq']} on the {group_label(entry['desc'])} group"


def attribute(ranks: list[RankEvidence]) -> Verdict:
    by_rank = {e.rank: e for e in ranks}
    waiting: dict[str, list[int]] = {}
    behind: list[tuple[int, str, list[int]]] = []  # (created_ns, pending, ranks behind it)
    for evidence in ranks:
        pending = _pending(evidence)
        if pending is None:
            continue
        name, entry = pending
        waiting.setdefault(_describe(name, entry), []).append(evidence.rank)
        late = [
            other.rank
            for other in ranks
            if other.groups is not None and name in other.groups and other.groups[name]["seq"] < entry["seq"]
        ]
        if late:
            behind.append((entry["created_ns"], _describe(name, entry), late))
    stopped = [e.rank for e in ranks if e.stopped]
    silent = [e.rank for e in ranks if e.groups is None and not e.stopped]
    if stopped:
        culprits, how = stopped, "is stopped (SIGSTOP: it runs no code)"
    elif silent:
        culprits, how = silent, "does not answer (it holds the GIL or is stuck in native code)"
    elif behind:
        _, pending, late = min(behind)
        culprits, how = sorted(set(late)), "stalled"
        waiting = {pending: waiting.get(pending, [])}
    else:  # no collective tells them apart: the rank stalled longest, outside a collective if one is
        outside = [e for e in ranks if e.phase in ("data", "checkpoint", "startup")] or ranks
        culprits, how = [max(outside, key=lambda e: e.stalled_seconds).rank], "stalled"
    first = by_rank[culprits[0]]
    names = ", ".join(str(r) for r in culprits)
    nodes = ", ".join(sorted({by_rank[r].node for r in culprits}))
    who = f"rank {names}" if len(culprits) == 1 else f"ranks {names}"
    line = f"hang: {who} (node {nodes}) {how} in {first.phase} at step {first.step}"
    waits = {what: [r for r in waiters if r not in culprits] for what, waiters in waiting.items()}
    waits = {what: waiters for what, waiters in waits.items() if waiters}
    if waits:
        what, waiters = Counter({what: len(w) for what, w in waits.items()}).most_common(1)[0]
        line += f"; {waiters} rank{'s wait' if waiters > 1 else ' waits'} in {what}"
    return Verdict(line, culprits, waits)
