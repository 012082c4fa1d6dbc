"""Who a hang is waiting for, from what every rank of the node said (or could not say) when it was detected.

Evidence per rank: its phase and step (heartbeat slot), whether its process is stopped (/proc), whether it
answered the flight-recorder request (a rank holding the GIL or stopped cannot), and per process group the
sequence numbers of the last collective it enqueued and the last that completed, with its recent collectives.
Sequence numbers, not entry states, decide: gloo's entries stay `scheduled` whether done or not. In order:
  1. a stopped or silent rank is the culprit;
  2. a rank outside any collective whose last sequence number on a group is below the collective its peers are
     blocked in has stalled (a data loader, a slow disk, a sleep);
  3. ranks whose collective #s on a group is another op or shape than the others' took another code path;
  4. otherwise the rank stalled longest (outside a collective, if one is).
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
    return "world" if desc in ("default_pg", "") else desc.removeprefix("mesh_")


def blocked_in(evidence: RankEvidence) -> tuple[str, dict] | None:
    """The group and entry of the collective this rank is blocked in (enqueued but not completed), if any."""
    pending = [(n, g) for n, g in (evidence.groups or {}).items() if g["enqueued"] > g["completed"]]
    return max(pending, key=lambda item: item[1]["record"]) if pending else None


def _describe(name: str, group: dict) -> str:
    return f"{group['op']} #{group['enqueued']} on the {group_label(group['desc'])} group"


def _stalled_outside(ranks: list[RankEvidence]) -> tuple[list[int], str] | None:
    """Rule 2: ranks not in any collective, behind the oldest collective their peers are blocked in."""
    findings = []
    for evidence in ranks:
        if (blocked := blocked_in(evidence)) is None:
            continue
        name, group = blocked
        late = [
            other.rank
            for other in ranks
            if other.groups is not None
            and blocked_in(other) is None
            and name in other.groups
            and other.groups[name]["enqueued"] < group["enqueued"]
        ]
        if late:
            findings.append((group["created_ns"], _describe(name, group), late))
    if not findings:
        return None
    _, pending, late = min(findings)
    return sorted(set(late)), pending


def _diverged(ranks: list[RankEvidence]) -> tuple[list[int], str] | None:
    """Rule 3: the first sequence number of a group at which members enqueued different collectives."""
    answered = [e for e in ranks if e.groups]
    for name in sorted({n for e in answered for n in e.groups}):
        members = {
            e.rank: {seq: (op, str(sizes)) for seq, op, sizes in e.groups[name]["recent"]}
            for e in answered
            if name in e.groups
        }
        common = set.intersection(*(set(seen) for seen in members.values())) if len(members) > 1 else set()
        for seq in sorted(common):
            signatures = Counter(seen[seq] for seen in members.values())
            if len(signatures) > 1:
                usual = signatures.most_common(1)[0][0]
                odd = sorted(rank for rank, seen in members.items() if seen[seq] != usual)
                if 2 * len(odd) >= len(members):  # no clear majority: an odd one out can't be named
                    continue
                desc = next(e.groups[name]["desc"] for e in answered if name in e.groups)
                return odd, f"{usual[0]} #{seq} on the {group_label(desc)} group"
    return None


def attribute(ranks: list[RankEvidence]) -> Verdict:
    by_rank = {e.rank: e for e in ranks}
    stopped = [e.rank for e in ranks if e.stopped]
    silent = [e.rank for e in ranks if e.groups is None and not e.stopped]
    if stopped:
        culprits, how = stopped, "is stopped (SIGSTOP: it runs no code)"
    elif silent:
        culprits, how = silent, "does not answer (it holds the GIL or is stuck in native code)"
    elif found := _stalled_outside(ranks):
        culprits, how = found[0], "stalled"
    elif found := _diverged(ranks):
        culprits, how = found[0], f"took another code path (its {found[1]} differs from the other ranks')"
    else:  # nothing tells them apart: the rank stalled longest, outside a collective if one is
        outside = [e for e in ranks if blocked_in(e) is None] or ranks
        culprits, how = [max(outside, key=lambda e: e.stalled_seconds).rank], "stalled"
    first = by_rank[culprits[0]]
    names = ", ".join(str(r) for r in culprits)
    nodes = ", ".join(sorted({by_rank[r].node for r in culprits}))
    who = f"rank {names}" if len(culprits) == 1 else f"ranks {names}"
    line = f"hang: {who} (node {nodes}) {how} in {first.phase} at step {first.step}"
    waiting: dict[str, list[int]] = {}
    for evidence in ranks:
        if evidence.rank not in culprits and (blocked := blocked_in(evidence)) is not None:
            waiting.setdefault(_describe(*blocked), []).append(evidence.rank)
    if waiting:
        what, waiters = max(waiting.items(), key=lambda item: len(item[1]))
        line += f"; {len(waiters)} rank{'s wait' if len(waiters) > 1 else ' waits'} in {what}"
    return Verdict(line, culprits, waiting)
