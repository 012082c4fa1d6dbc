"""Finite loss spikes: detected from the values every rank agrees on, replayed to tell a faulty rank from bad
data, then handled by policy (roll back past the samples, skip the update, stop, or warn).

The detector keeps an exponential moving mean and variance of the loss and of the gradient norm and scores each
step by its z-score against them; it sees only the step's agreed values (the all-reduce every step already does),
so every rank takes the same decision at no extra collective. Its statistics, the skipped sample windows and the
rollback count travel in every checkpoint's trainer_state.json, so a resumed run is not blind for a warm-up.
The idea of replaying a suspicious step to separate a transient fault from a reproducible one is Megatron-LM's
rerun state machine (`megatron/core/rerun_state_machine.py`); the z-score/EMA detector and the rollback-and-skip
remedy are what the PaLM (Chowdhery et al. 2022, §5.1) and OPT logbooks describe doing by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from nanotron.config import Config, StabilityConfig
from nanotron.data.skips import SampleSkips, read_run_skips

# The standard deviation a z-score divides by is at least this much (in log space: a 1% change): a flat curve
# (variance ~0) must not turn rounding noise into spikes.
STD_FLOOR = 0.01
SIGNALS = ("loss", "grad_norm")


@dataclass
class RunningStats:
    """One signal's running forecast: level and trend of its logarithm (Holt's linear exponential smoothing, in
    error-correction form, with gains 1 - decay and (1 - decay)^2) and the exponentially weighted variance of the
    one-step forecast errors. Log space makes a spike a ratio (5x is 5x at any loss); the trend keeps a loss that
    falls steadily from looking like a series of negative surprises whose variance would then hide a real jump."""

    level: float = 0.0
    trend: float = 0.0
    var: float = 0.0

    def z(self, value: float) -> float:
        return (_log(value) - self.level - self.trend) / max(math.sqrt(self.var), STD_FLOOR)

    def update(self, value: float, decay: float, first: bool) -> None:
        if first:
            self.level, self.trend, self.var = _log(value), 0.0, 0.0
            return
        gain = 1 - decay
        error = _log(value) - self.level - self.trend
        self.level += self.trend + gain * error
        self.trend += gain * gain * error
        self.var = decay * self.var + gain * error * error


def _log(value: float) -> float:
    return math.log(max(value, 1e-30))


class SpikeDetector:
    """z-scores of the loss and the gradient norm; a spike once warm_up steps have been observed."""

    def __init__(self, cfg: StabilityConfig) -> None:
        self.cfg = cfg
        self.observed = 0
        self.stats = {name: RunningStats() for name in SIGNALS}
        self.max_z = {name: 0.0 for name in SIGNALS}  # largest z-score seen after warm-up (how close a run came)

    def scores(self, loss: float, grad_norm: float) -> dict[str, float]:
        if not self.observed:  # nothing to compare with yet
            return {name: 0.0 for name in SIGNALS}
        return {name: self.stats[name].z(value) for name, value in zip(SIGNALS, (loss, grad_norm))}

    def is_spike(self, z: dict[str, float]) -> bool:
        if not self.cfg.enabled or self.observed < self.cfg.warmup_steps:
            return False
        limits = {"loss": self.cfg.loss_z, "grad_norm": self.cfg.grad_norm_z}
        return any(limits[name] > 0 and z[name] > limits[name] for name in SIGNALS)

    def observe(self, loss: float, grad_norm: float) -> None:
        """An applied step's values join the running statistics (a spike's never do, unless only warned of)."""
        z = self.scores(loss, grad_norm)
        if self.observed >= self.cfg.warmup_steps:
            self.max_z = {name: max(self.max_z[name], z[name]) for name in SIGNALS}
        for name, value in zip(SIGNALS, (loss, grad_norm)):
            self.stats[name].update(value, self.cfg.ema_decay, first=self.observed == 0)
        self.observed += 1

    def state_dict(self) -> dict:
        stats = {name: [s.level, s.trend, s.var] for name, s in self.stats.items()}
        return {"observed": self.observed, "stats": stats, "max_z": dict(self.max_z)}

    def load_state_dict(self, state: dict) -> None:
        self.observed = int(state["observed"])
        self.stats = {name: RunningStats(*map(float, state["stats"][name])) for name in SIGNALS}
        self.max_z = {name: float(state["max_z"][name]) for name in SIGNALS}


class Stability:
    """What a run knows about its spikes, saved with its progress: the detector, the skipped windows (the config's,
    the run dir's and the checkpoint's, united) and the rollbacks so far."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg.stability
        self.detector = SpikeDetector(cfg.stability)
        self.skips = SampleSkips.parse(cfg.data.skip_samples)
        self.skips.update(read_run_skips(cfg.run_dir))
        self.rollbacks = 0
        self.last_z: dict[str, float] = {name: 0.0 for name in SIGNALS}

    def state_dict(self) -> dict:
        return {
            "detector": self.detector.state_dict(),
            "skipped_samples": self.skips.to_list(),
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: dict | None, where: Path) -> None:
        """A checkpoint's state. Windows and rollbacks only grow: a rollback loads an older checkpoint than what
        the run already knows."""
        if state is None:  # saved before stability existed: start observing afresh
            return
        try:
            self.detector.load_state_dict(state["detector"])
            rollbacks = int(state["rollbacks"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"stability: {error!r}") from None
        self.skips.update(SampleSkips.from_list(state.get("skipped_samples"), f"{where}: stability.skipped_samples"))
        self.rollbacks = max(self.rollbacks, rollbacks)

    def window(self, first_sample: int, global_batch_size: int, floor_sample: int) -> tuple[int, int]:
        """The data positions a rollback skips: those of the window_steps steps ending with the one that starts at
        trained sample `first_sample`, never before the rollback target's position (trained sample `floor_sample`)."""
        start = max(first_sample - (self.cfg.window_steps - 1) * global_batch_size, floor_sample)
        return self.skips.position(start), self.skips.position(first_sample + global_batch_size - 1) + 1


def differs(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) > tolerance * max(abs(a), abs(b), 1e-30)


def differing_ranks(first: list[list[float]], second: list[list[float]], tolerance: float) -> tuple[list[int], str]:
    """The ranks whose own contribution changed between a step and its replay, by the earliest value that did:
    the loss (computed from the rank's forward alone) before the gradient share (mixed over dp by reduction)."""
    for column, what in ((0, "loss"), (1, "gradient")):
        ranks = [r for r, (a, b) in enumerate(zip(first, second)) if differs(a[column], b[column], tolerance)]
        if ranks:
            return ranks, what
    return [], ""
