"""Straggler scores: how late each rank arrives at the step's collective, relative to the first to arrive.

Data parallelism's all-reduce evens out section times (every rank leaves the step together), so the signal is
the wait inside the step's one collective: a slow rank arrives last and waits least. Each rank adds up its
wait over `watch.straggler_interval` steps (two clock reads a step); then one all-gather of two floats per rank
(its wait and its step time) gives every rank the scores: score_r = (max wait - wait_r) / (steps x median step
time), the fraction of a step by which rank r arrives after the earliest. A rank 3x slower than the others
scores ~2/3, the others ~0. Cost: O(1) a step, and 8 bytes per rank every interval (4 KiB at 512 ranks).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanotron.config import WatchConfig
from nanotron.errors import NodeFaultError
from nanotron.step_end import StepInfo, StepReport
from nanotron.watch.nodes import node_name


class StragglerScores:
    def __init__(self, cfg: WatchConfig, rank: int, world_size: int, device: torch.device):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.waited = self.step_seconds = 0.0
        self.steps, self.late_intervals = 0, [0] * world_size
        self.step_started = time.perf_counter()
        self.nodes = [node_name()] * world_size
        if world_size > 1 and cfg.straggler_interval:
            dist.all_gather_object(self.nodes, node_name())  # once, at start-up

    def timed(self, collective: Callable) -> Callable:
        """The step's collective, adding the time this rank waits in each call."""

        def timed_collective(*args):
            started = time.perf_counter()
            result = collective(*args)
            self.waited += time.perf_counter() - started
            return result

        return timed_collective

    def step_end(self, info: StepInfo) -> StepReport | None:
        """Every straggler_interval steps: the scores, and a rank late for straggler_patience intervals in a row
        named (warned of, or its node excluded: watch.straggler_action). Every rank calls it (a collective) and
        holds the same scores, so every rank takes the same decision."""
        if (scores := self.count_step()) is None:
            return None
        report = StepReport([({"step": info.step} | scores, None)])
        for rank in self.persistent():
            line = self.describe(rank, scores)
            if self.cfg.straggler_action == "exclude":
                message = f"{line}; stopped to requeue without its node (watch.straggler_action)"
                report.stop = NodeFaultError(message, [self.nodes[rank]])
                return report
            report.entries.append((None, f"warning: {line}"))
        return report

    def count_step(self) -> dict[str, float] | None:
        """Counts a step; every straggler_interval steps, the scores (a collective)."""
        now = time.perf_counter()
        self.step_seconds += now - self.step_started
        self.step_started, self.steps = now, self.steps + 1
        if not self.cfg.straggler_interval or self.world_size == 1 or self.steps < self.cfg.straggler_interval:
            return None
        mine = torch.tensor([self.waited, self.step_seconds], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)  # gloo has no all_gather_into_tensor
        waits, step_times = torch.stack(every).T.tolist()
        scores, step_time = lateness(waits, step_times, self.steps)
        self.waited = self.step_seconds = 0.0
        self.steps = 0
        self.late_intervals = [
            n + 1 if s > self.cfg.straggler_threshold else 0 for n, s in zip(self.late_intervals, scores)
        ]
        return {f"straggler/rank_{rank}": score for rank, score in enumerate(scores)} | {
            "straggler/max": max(scores),
            "straggler/step_time": step_time,
        }

    def persistent(self) -> list[int]:
        """Ranks late by more than the threshold for straggler_patience intervals in a row."""
        return [r for r, n in enumerate(self.late_intervals) if n >= self.cfg.straggler_patience]

    def describe(self, rank: int, scores: dict[str, float]) -> str:
        score = scores[f"straggler/rank_{rank}"]
        return (
            f"straggler: rank {rank} (node {self.nodes[rank]}) arrives {score:.2f} of a step "
            f"({score * scores['straggler/step_time']:.3f}s) after the first rank at the step's collective, "
            f"{self.late_intervals[rank]} intervals of {self.cfg.straggler_interval} steps in a row"
        )


def lateness(waits: list[float], step_times: list[float], steps: int) -> tuple[list[float], float]:
    """(each rank's lateness as a fraction of the median step, the median step time) from the seconds each rank
    waited in the step's collective and spent in its steps over `steps` steps: the first to arrive waits longest."""
    step_time = statistics.median(step_times) / steps
    if step_time <= 0:
        return [0.0] * len(waits), 0.0
    return [(max(waits) - wait) / steps / step_time for wait in waits], step_time
