"""The end of a training step as the services that act there see it: a `StepInfo` in, a `StepReport` out.

Each service (activation statistics, MoE balance, straggler scores, evaluation, checkpoint cadence) has one method,
`step_end(info)`, which the trainer calls on every rank, in a fixed order, after each step it keeps. A service
gets what it needs at construction and here, never the trainer; it hands back what to log and, at most, a reason to
stop, and the trainer carries that out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from nanotron.errors import UserError


@dataclass(frozen=True)
class StepInfo:
    step: int  # the step just done, 1-based
    applied: bool  # its update was applied (not skipped)
    logging: bool  # a logging step: every logging.log_interval-th, and the last
    last: bool  # the run's last step (training.steps)
    stopping: bool  # a stop was agreed: the run saves and ends after this step


@dataclass
class StepReport:
    """Metrics records with their console lines (either may be None), logged in order by the logging rank; then a
    stop every rank decided alike (a node fault names its nodes for the requeue)."""

    entries: list[tuple[dict | None, str | None]] = field(default_factory=list)
    stop: UserError | None = None


class StepEnd(Protocol):
    def step_end(self, info: StepInfo) -> StepReport | None: ...
