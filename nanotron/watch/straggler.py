"""Straggler scores: how much longer each rank works in a step than its peers do.

Collectives even out a slow rank: every all-gather, reduce-scatter and all-reduce inside the step waits for it,
so all ranks leave each one, and reach the step's last, together. What differs is where each rank's time goes:
the slow rank works while its peers wait for it. So each rank times its own work in the step, the step's wall
time less the time it spent blocked in collectives (`collective_wait_clock`: two clock reads per wait, two a
step), and adds it up over `watch.straggler_interval` steps; then one all-gather of two floats per rank (its own
time and its step time) gives every rank the scores: score_r = own_r / (the median own time of the ranks that run
r's pipeline stage) - 1, how much longer rank r works than its peers (0 if it works less). A rank at half speed
scores ~1, one 3x slower ~2, the others ~0. Cost: O(1) a step and per collective, and 8 bytes per rank every
interval (4 KiB at 512 ranks).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nanotron.config import WatchConfig
from nanotron.errors import NodeFaultError
from nanotron.parallel.torch_private import collective_wait_clock
from nanotron.step_end import StepInfo, StepReport
from nanotron.watch.nodes import node_name


class StragglerScores:
    def __init__(self, cfg: WatchConfig, rank: int, world_size: int, device: torch.device, stage: int = 0):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.own_seconds = self.step_seconds = 0.0
        self.steps = self.timed_steps = 0
        self.slow_intervals = [0] * world_size
        self.started = False  # the process's first step (lazy set-up, first allocations) is not timed
        self.waited = collective_wait_clock()
        self.nodes, self.stages = [node_name()] * world_size, [stage] * world_size
        if world_size > 1 and cfg.straggler_interval:
            places = [(node_name(), stage)] * world_size
            dist.all_gather_object(places, (node_name(), stage))  # once, at start-up
            self.nodes, self.stages = [list(column) for column in zip(*places)]

    @contextmanager
    def step(self) -> Iterator[None]:
        """A training step: its wall time, and this rank's own part of it (the wall time less collective waits)."""
        started, waited = time.perf_counter(), self.waited()
        yield
        if not self.started:
            self.started = True
            return
        seconds = time.perf_counter() - started
        self.step_seconds += seconds
        self.own_seconds += seconds - (self.waited() - waited)
        self.timed_steps += 1

    def step_end(self, info: StepInfo) -> StepReport | None:
        """Every straggler_interval steps: the scores, and a rank slow for straggler_patience intervals in a row
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
        self.steps += 1
        if not self.cfg.straggler_interval or self.world_size == 1 or self.steps < self.cfg.straggler_interval:
            return None
        mine = torch.tensor([self.own_seconds, self.step_seconds], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)  # gloo has no all_gather_into_tensor
        own, step_times = torch.stack(every).T.tolist()
        scores, step_time = excess(own, step_times, self.stages, max(self.timed_steps, 1))
        self.own_seconds = self.step_seconds = 0.0
        self.steps = self.timed_steps = 0
        self.slow_intervals = [
            n + 1 if s > self.cfg.straggler_threshold else 0 for n, s in zip(self.slow_intervals, scores)
        ]
        return {f"straggler/rank_{rank}": score for rank, score in enumerate(scores)} | {
            "straggler/max": max(scores),
            "straggler/step_time": step_time,
        }

    def persistent(self) -> list[int]:
        """Ranks slower than the threshold for straggler_patience intervals in a row."""
        return [r for r, n in enumerate(self.slow_intervals) if n >= self.cfg.straggler_patience]

    def describe(self, rank: int, scores: dict[str, float]) -> str:
        score = scores[f"straggler/rank_{rank}"]
        return (
            f"straggler: rank {rank} (node {self.nodes[rank]}) works {1 + score:.2f}x as long as its peers between "
            f"collectives (steps of {scores['straggler/step_time']:.3f}s), {self.slow_intervals[rank]} intervals of "
            f"{self.cfg.straggler_interval} steps in a row"
        )


def excess(own: list[float], step_times: list[float], stages: list[int], steps: int) -> tuple[list[float], float]:
    """(each rank's own time beyond the median of the ranks that run its pipeline stage, as a fraction of that
    median; the median step time) from each rank's own seconds and step seconds over `steps` steps. Stages differ
    in work (the head's stage does more), the ranks of one stage do the same; the lower median of an even count
    keeps a two-rank group's reference on the faster rank."""
    reference = {stage: statistics.median_low(o for o, s in zip(own, stages) if s == stage) for stage in set(stages)}
    scores = [max(0.0, o / reference[s] - 1) if reference[s] > 0 else 0.0 for o, s in zip(own, stages)]
    return scores, statistics.median(step_times) / steps
