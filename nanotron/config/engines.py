"""The pipeline engines `parallelism.pp_engine` names (`PP_ENGINES`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineEngine:
    """What a `parallelism.pp_engine` is: the one table that the schedule builder (`parallel/pipeline.py`),
    config validation and the planner read."""

    schedule: str  # class name in torch.distributed.pipelining
    stage_order: str  # "one": a stage per rank; "loop": rank r runs r, r+pp, ...; "v": rank r runs r and 2pp-1-r
    split_backward: bool  # input and weight gradients in separate passes (zero bubble)
    fills_pipeline: bool  # keeps pp microbatches in flight: needs grad_accum_steps >= pp
    forward_all_first: bool = False  # every forward before any backward (GPipe): all activations held at once

    def stages_per_rank(self, pp_stages_per_rank: int) -> int:
        return 1 if self.stage_order == "one" else pp_stages_per_rank

    def min_microbatches(self, pp: int) -> int:
        return pp if self.fills_pipeline else 1

    def bubble_fraction(self, pp: int, n_microbatches: int, pp_stages_per_rank: int) -> float:
        """Idle time relative to compute: (pp-1)/(microbatches x loop-interleaved stages); a split backward
        fills two thirds of it with deferred weight gradients."""
        if pp == 1:
            return 0.0
        v = pp_stages_per_rank if self.stage_order == "loop" else 1
        return (pp - 1) / (n_microbatches * v) * (1 / 3 if self.split_backward else 1)


PP_ENGINES = {
    "1f1b": PipelineEngine("Schedule1F1B", "one", split_backward=False, fills_pipeline=True),
    "afab": PipelineEngine("ScheduleGPipe", "one", split_backward=False, fills_pipeline=False, forward_all_first=True),
    "interleaved_1f1b": PipelineEngine("ScheduleInterleaved1F1B", "loop", split_backward=False, fills_pipeline=True),
    "zero_bubble": PipelineEngine("ScheduleInterleavedZeroBubble", "loop", split_backward=True, fills_pipeline=True),
    "zbv": PipelineEngine("ScheduleZBVZeroBubble", "v", split_backward=True, fills_pipeline=False),
}
