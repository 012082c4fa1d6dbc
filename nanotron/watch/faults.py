"""A fault injector for tests and drills (never for production runs): `NANOTRON_FAULT=rank:R,step:S,kind:K`, or
`node:N,step:S,kind:K` for every rank on node N (what a bad node looks like: requeued elsewhere, the job is well),
or both (rank R, only while it runs on node N). `restart:A` limits it to launch attempt A (0: the first; an
in-place restart or a requeue is the next attempt), so a drill can stage a transient fault.

Kinds, each acting when the rank enters the named phase of step S (and, for `slow` and `slow_disk`, every step
from S on):
  sleep            sleeps in `data` (a stuck data loader; the GIL is free)
  gil_lock         blocks in native code in `forward` holding the GIL (a C extension that waits without
                   releasing it); it burns no CPU
  sigstop          stops itself with SIGSTOP in `data` (the process can run no code at all)
  skip_collective  skips the step's all-reduce in `optimizer` (ranks disagree on collectives: a hang on NCCL; on
                   gloo the rank aborts when it meets its peers' larger message)
  slow:F           from step S on, sleeps (F - 1) x the step's compute time before the step's collective
  crash            kills itself with SIGKILL in `data`
  slow_disk:T      every checkpoint save takes T seconds longer (a slow or overloaded filesystem)
  bad_matmul       the doctor's matmul gives a wrong result on this rank (silent data corruption)
  loss_spike:F     this rank's loss of step S is multiplied by F, in the step's first pass only (a transient fault
                   that the stability replay recomputes cleanly)
`nanotron doctor` (and training.preflight) also honour `slow:F` (every timed check F x slower) and `slow_disk:T`.

In training, a `Drill` applies the fault from outside the step: it wraps the step's pieces (the phase beats, the
microbatch run, the step's collective), so the step itself has no fault branches.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from nanotron.errors import LAUNCH_ATTEMPT_VARIABLE, ConfigError
from nanotron.watch.nodes import node_name

FAULT_VARIABLE = "NANOTRON_FAULT"
ATTEMPT_VARIABLE = LAUNCH_ATTEMPT_VARIABLE  # set by nanotron.launch.torchrun (0, 1, ... across in-place restarts)
KINDS = ("sleep", "gil_lock", "sigstop", "skip_collective", "slow", "crash", "slow_disk", "bad_matmul", "loss_spike")
_ONGOING = ("slow", "slow_disk")  # take a value, and act at every step from S on
_VALUED = (*_ONGOING, "loss_spike")
# Where each kind acts: a phase of the heartbeat, or "step_collective", just before the step's collective.
_PHASE = {"sleep": "data", "gil_lock": "forward", "sigstop": "data", "crash": "data", "slow": "step_collective"}
_PHASE["slow_disk"] = "checkpoint"


@dataclass
class Fault:
    rank: int | None  # None: every rank (of `node`)
    step: int
    kind: str
    factor: float = 1.0
    node: str | None = None
    attempt: int | None = None
    _compute_started: float = 0.0
    _fired: bool = False

    @classmethod
    def from_env(cls, environ: dict | None = None) -> Fault | None:
        spec = (os.environ if environ is None else environ).get(FAULT_VARIABLE, "")
        return cls.parse(spec) if spec else None

    @classmethod
    def parse(cls, spec: str) -> Fault:
        hint = (
            f"{FAULT_VARIABLE}={spec!r}: expected rank:R,step:S,kind:K (or node:N instead of or beside rank:R) with K "
            f"one of {', '.join(KINDS)} (slow:F, slow_disk:T, loss_spike:F)"
        )
        fields: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = part.partition(":")
            if not sep or key not in ("rank", "node", "step", "kind", "restart") or key in fields:
                raise ConfigError(hint)
            fields[key] = value if key != "kind" else part[len("kind:") :]
        kind, _, factor = fields.get("kind", "").partition(":")
        try:
            rank = int(fields["rank"]) if "rank" in fields else None
            attempt = int(fields["restart"]) if "restart" in fields else None
            fault = cls(rank, int(fields["step"]), kind, float(factor) if factor else 1.0, fields.get("node"), attempt)
        except (KeyError, ValueError):
            raise ConfigError(hint) from None
        bad_rank = rank is None and fault.node is None or rank is not None and rank < 0
        if kind not in KINDS or (kind in _VALUED) != bool(factor) or fault.factor < (1 if kind == "slow" else 0):
            raise ConfigError(hint)
        if bad_rank:
            raise ConfigError(hint)
        return fault

    def applies_to(self, rank: int, node: str) -> bool:
        here = self.attempt is None or str(self.attempt) == os.environ.get(ATTEMPT_VARIABLE, "0")
        return here and (self.rank is None or rank == self.rank) and (self.node is None or node == self.node)

    def at(self, rank: int, phase: str, step: int) -> None:
        """Called as rank `rank` enters `phase` of step `step`."""
        if not self.applies_to(rank, self.here) or step < self.step or (step > self.step and self.kind not in _ONGOING):
            return
        if self.kind == "slow" and phase == "forward":
            self._compute_started = time.perf_counter()
        if phase != _PHASE.get(self.kind):
            return
        if self.kind == "sleep":
            time.sleep(10**6)
        elif self.kind == "gil_lock":
            sys.setswitchinterval(10**6)  # never hand the GIL to another thread between the calls below
            libc = ctypes.PyDLL(None)  # a PyDLL's calls keep the GIL (a CDLL's release it)
            while True:
                libc.pause()  # returns when a signal arrives (the watcher asking for stacks, SIGTERM)
        elif self.kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "slow":
            time.sleep((self.factor - 1) * (time.perf_counter() - self._compute_started))
        elif self.kind == "slow_disk":
            time.sleep(self.factor)

    def loss_factor(self, rank: int, step: int) -> float:
        """loss_spike: the factor on this rank's loss at step S, once (a replay of the step sees the clean loss)."""
        if self.kind != "loss_spike" or step != self.step or not self.applies_to(rank, self.here) or self._fired:
            return 1.0
        self._fired = True
        return self.factor

    def skips_collective(self, rank: int, step: int) -> bool:
        return self.kind == "skip_collective" and self.applies_to(rank, self.here) and step == self.step

    @property
    def here(self) -> str:
        return node_name()


class Drill:
    """The configured fault (NANOTRON_FAULT) around the training step's pieces on rank `rank`; without one, each
    piece is handed back as it is. It follows the step from the beats, as the heartbeat does."""

    def __init__(self, fault: Fault | None, rank: int) -> None:
        self.fault, self.rank, self.step = fault, rank, 0

    @classmethod
    def from_env(cls, rank: int) -> Drill:
        return cls(Fault.from_env(), rank)

    def phases(self, beat: Callable[..., None]) -> Callable[..., None]:
        """`beat(phase, step=None)`, then the fault acts as this rank enters `phase` of the step."""
        if self.fault is None:
            return beat

        def drilled(phase: str, step: int | None = None) -> None:
            beat(phase, step)
            if step is not None:
                self.step = step
            self.fault.at(self.rank, phase, self.step)

        return drilled

    def losses(self, forward_backward: Callable) -> Callable:
        """The microbatch run, its loss multiplied by a loss_spike's factor (in step S's first pass only)."""
        if self.fault is None:
            return forward_backward

        def drilled(batch):
            loss = forward_backward(batch)
            return loss if loss is None else loss * self.fault.loss_factor(self.rank, self.step)

        return drilled

    def collective(self, agree: Callable) -> Callable:
        """The step's collective (`ParallelContext.agree`), after a `slow` fault's wait, or skipped on this rank."""
        if self.fault is None:
            return agree

        def drilled(flags: list, values: list = ()) -> tuple[list[bool], list[float]]:
            self.fault.at(self.rank, "step_collective", self.step)
            if self.fault.skips_collective(self.rank, self.step):
                return [False] * len(flags), [0.0] * len(values)
            return agree(flags, values)

        return drilled
