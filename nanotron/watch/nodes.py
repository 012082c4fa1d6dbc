"""Several nodes, one verdict: the watchers meet in the launcher's key-value store (torchrun's rendezvous store).

The first watcher to see a hang announces an incident (compare-and-set: exactly one wins and leads); every other
watcher sees the announcement at its next poll, gathers its own ranks' evidence at once (its limits need not have
expired) and publishes it. The leader waits for every node (or a deadline), names the culprit from all of it,
prints the one line and publishes the verdict, which each watcher acts on for its own ranks. The first node to act
ends ranks that the others' ranks are blocked in collectives with (and, if it hosts the rendezvous store, takes the
store with it when its launcher exits): the others' ranks fail, or their torchrun does, while their own watcher is
still writing the verdict, and their launcher waits for it (`KeptWatcher.verdict`), so every node exits with the
verdict's code and the job script requeues without the culprit.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict
from datetime import timedelta

from nanotron.watch.attribution import RankEvidence, Verdict

PREFIX = "nanotron/watch/"
GATHER_SECONDS = 20.0  # how long the leader waits for the other nodes' evidence


def node_name() -> str:
    """This node's name as the scheduler knows it (what `sbatch --exclude` takes), else its host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class Coordinator:
    def __init__(self, address: str, nnodes: int, node: str):
        self.address, self.nnodes, self.node, self._store = address, nnodes, node, None
        self._unreachable_since = 0.0

    @property
    def store(self):
        if self._store is None:
            from torch.distributed import TCPStore

            host, _, port = self.address.rpartition(":")
            self._store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        return self._store

    def announced(self) -> str | None:
        """The incident another node announced, if any (a cheap check, made every poll; an unreachable store is
        tried again after 30 s, so a missing one never holds up the watch)."""
        if time.time() - self._unreachable_since < 30:
            return None
        try:
            if self.store.check([PREFIX + "incident"]):
                return self.store.get(PREFIX + "incident").decode()
        except Exception:  # noqa: BLE001 - the store is not up yet, or gone: nothing was announced through it
            self._store, self._unreachable_since = None, time.time()
        return None

    def announce(self, incident: str) -> tuple[str, bool]:
        """(the incident id every node uses, whether this node leads: the first to ask does)."""
        incident = self.store.compare_set(PREFIX + "incident", "", incident).decode()
        return incident, self.store.add(f"{PREFIX}{incident}/leader", 1) == 1

    def publish(self, incident: str, evidence: list[RankEvidence]) -> None:
        index = self.store.add(f"{PREFIX}{incident}/nodes", 1)
        self.store.set(f"{PREFIX}{incident}/node/{index}", json.dumps([asdict(e) for e in evidence]))

    def collect(self, incident: str) -> list[RankEvidence]:
        """Every node's evidence that arrived before the deadline."""
        deadline = time.time() + GATHER_SECONDS
        while self.store.add(f"{PREFIX}{incident}/nodes", 0) < self.nnodes and time.time() < deadline:
            time.sleep(0.2)
        evidence = []
        for index in range(1, self.store.add(f"{PREFIX}{incident}/nodes", 0) + 1):
            evidence += [RankEvidence(**e) for e in json.loads(self.store.get(f"{PREFIX}{incident}/node/{index}"))]
        return evidence

    def decide(self, incident: str, verdict: Verdict, nodes: list[str]) -> None:
        record = {"line": verdict.line, "culprits": verdict.culprits, "nodes": nodes}
        self.store.set(f"{PREFIX}{incident}/verdict", json.dumps(record))

    def verdict(self, incident: str) -> dict | None:
        key = f"{PREFIX}{incident}/verdict"
        deadline = time.time() + GATHER_SECONDS + 10
        while time.time() < deadline:
            try:
                if self.store.check([key]):
                    return json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - the store's host went away: decide alone
                return None
            time.sleep(0.2)
        return None
