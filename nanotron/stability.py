"""Finite loss spikes: detected from the values every rank agrees on, replayed to tell a faulty rank from bad
data, then handled by policy (roll back past the samples, skip the update, stop, or warn).

The detector keeps an exponentially smoothed forecast (level and trend of the logarithm) of the loss and of the
gradient norm, with the variance of its errors, and scores each step by its z-score against them. It sees only
the step's agreed values (the all-reduce every step already does), so every rank takes the same decision at no
extra collective. Its statistics, the skipped sample windows and the rollback count travel in every checkpoint's
trainer_state.json, so a resumed run is not blind for a warm-up.
The idea of replaying a suspicious step to separate a transient fault from a reproducible one is Megatron-LM's
rerun state machine (`megatron/core/rerun_state_machine.py`); spotting spikes and the rollback-and-skip remedy
are what the PaLM (Chowdhery et al. 2022, §5.1) and OPT logbooks describe doing by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nanotron.checkpoint.layout import committed_steps, step_of
from nanotron.config import Config, StabilityConfig
from nanotron.data.skips import SampleSkips, read_run_skips, write_run_skips
from nanotron.errors import NodeFaultError, SpikeError
from nanotron.watch.suspects import write_suspects

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


class SpikeGuard:
    """A step's spike check, replay and remedy. It works on the trainer's own parts (model runner, optimizers,
    checkpoints, metrics), as the trainer's hands for this one concern; the trainer only calls `check`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def check(self, loss: float, grad_norm: float, local_loss: torch.Tensor | None, local_norm: torch.Tensor) -> bool:
        """Scores the step (every rank holds the same agreed values: one decision for the job); on a spike, replays
        it and acts. Returns whether the step's update is applied."""
        t = self.trainer
        detector, cfg, step = t.stability.detector, t.cfg.stability, t.state.step + 1
        z = t.stability.last_z = detector.scores(loss, grad_norm)
        if not detector.is_spike(z):
            detector.observe(loss, grad_norm)
            return True
        event = {"step": step, "stability/loss": loss, "stability/grad_norm": grad_norm}
        event |= {"stability/loss_z": z["loss"], "stability/grad_norm_z": z["grad_norm"]}
        what = (
            f"stability: step {step} spiked (loss {loss:.4g}, z {z['loss']:.1f}; grad_norm {grad_norm:.4g}, "
            f"z {z['grad_norm']:.1f})"
        )
        if cfg.replay:
            replayed = self.replay((loss, grad_norm), local_loss, local_norm)
            if replayed is not None:  # a transient fault: the replayed step is the clean one
                ranks, seen, (loss2, norm2) = replayed
                event |= {"stability/action": "transient", "stability/ranks": ranks}
                named = ", ".join(f"rank {r} (node {t.stragglers.nodes[r]})" for r in ranks) or "no single rank"
                line = (
                    f"{what}; the replay gave loss {loss2:.4g}, grad_norm {norm2:.4g}: a transient fault, {seen} "
                    f"differed on {named}"
                )
                if cfg.on_transient == "stop":
                    t.metrics.log(event | {"stability/action": "exclude"}, line)
                    if t.ctx.rank == 0 and ranks:
                        nodes = sorted({t.stragglers.nodes[r] for r in ranks})
                        write_suspects(t.cfg.run_dir, nodes)
                    raise NodeFaultError(f"{line}; stopped to requeue without its node (stability.on_transient)")
                t.metrics.log(event, f"{line}; going on with the replayed step (stability.on_transient)")
                detector.observe(loss2, norm2)
                return True
            what += "; the replay reproduced it (the data or the optimisation, not a rank)"
        return self.act(event, what, loss, grad_norm)

    def replay(self, first: tuple[float, float], first_loss: torch.Tensor | None, first_norm: torch.Tensor):
        """Recomputes the step from the same state and batch. None if it reproduces the global loss and gradient
        norm (within replay_tolerance); else (the ranks whose own values changed, which value, the replay's global
        loss and gradient norm). Costs a step and an all-gather of 4 numbers per rank, on spiking steps only."""
        t = self.trainer
        mine = self.local_values(first_loss, first_norm)
        for optimizer in t.optimizers:
            optimizer.zero_grad(set_to_none=True)
        t.experts.reset()
        t.activation_stats.restart()
        t.beat("data", t.state.step + 1)
        loss, grad_norm = t.forward_backward()
        _, second = t.ctx.agree([], t.runner.step_shares(loss, grad_norm))
        tolerance = t.cfg.stability.replay_tolerance
        table = torch.tensor(mine + self.local_values(loss, grad_norm), dtype=torch.float64, device=t.ctx.device)
        gathered = [table]
        if t.ctx.world_size > 1:
            gathered = [torch.empty_like(table) for _ in range(t.ctx.world_size)]
            dist.all_gather(gathered, table)
        rows = [g.tolist() for g in gathered]
        ranks, seen = differing_ranks([r[:2] for r in rows], [r[2:] for r in rows], tolerance)
        if not ranks and not any(differs(a, b, tolerance) for a, b in zip(first, second)):
            return None
        return ranks, seen or "nothing rank-local", tuple(second)

    def local_values(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> list[float]:
        """This rank's own loss and the squared norm of its gradient shards before clipping: what a replay compares
        rank by rank."""
        t = self.trainer
        squares = sum(
            (g.to_local() if isinstance(g, DTensor) else g).double().square().sum()
            for g in (p.grad for p in t.params)
            if g is not None
        )
        clip = t.cfg.training.clip_grad
        coefficient = min(1.0, clip / (grad_norm.item() + 1e-6)) if clip > 0 else 1.0
        return [0.0 if loss is None else loss.item(), float(squares) / coefficient**2]

    def act(self, event: dict, what: str, loss: float, grad_norm: float) -> bool:
        """stability.action on a spike the replay reproduced (or that was not replayed); whether to apply it."""
        t = self.trainer
        action = t.cfg.stability.action
        if action == "warn":
            t.stability.detector.observe(loss, grad_norm)
            t.metrics.log(event | {"stability/action": "warn"}, f"warning: {what}; applied (stability.action=warn)")
            return True
        if action == "stop":
            t.metrics.log(event | {"stability/action": "stop"})
            raise SpikeError(
                f"{what}; stopped before applying it (stability.action=stop): resume from the last checkpoint "
                f"with data.skip_samples covering step {event['step']}'s samples, or a lower optimizer.lr"
            )
        if action == "rollback":
            reason = self.rollback(event, what)
            if reason is None:
                return False
            what += reason
        t.metrics.log(event | {"stability/action": "skip_step"}, f"warning: {what}; update skipped")
        return False

    def rollback(self, event: dict, what: str) -> str | None:
        """Reloads the newest committed checkpoint before the spike, skips the window of samples that led to it
        and goes on from there, in this process. Why not, when no checkpoint precedes the spike."""
        t = self.trainer
        cfg, step = t.cfg, event["step"]
        t.checkpoints.wait()  # an async save in flight commits first: it may be the one to go back to
        older = [path for path in committed_steps(cfg.checkpoint_dir) if step_of(path) < step]
        if not older:
            return f"; no committed checkpoint before step {step} to roll back to (checkpoint.interval)"
        if t.stability.rollbacks >= cfg.stability.max_rollbacks:
            t.metrics.log(event | {"stability/action": "stop"})
            raise SpikeError(
                f"{what}; stopped: stability.max_rollbacks={cfg.stability.max_rollbacks} rollbacks already "
                f"(windows skipped: {t.stability.skips.to_list()}); inspect the data around these samples, "
                "lower optimizer.lr or raise stability.max_rollbacks, and resume"
            )
        first = t.state.consumed_samples
        t.beat("checkpoint", step)
        t.checkpoints.load(older[-1])
        t.stability.rollbacks += 1
        window = t.stability.window(first, cfg.training.global_batch_size, t.state.consumed_samples)
        t.stability.skips.add(*window)
        if t.ctx.rank == 0:
            write_run_skips(cfg.run_dir, t.stability.skips)
        event |= {
            "stability/action": "rollback",
            "stability/window": list(window),
            "stability/rollback_to": t.state.step,
        }
        t.metrics.log(
            event,
            f"{what}; rolled back to step {t.state.step} ({older[-1]}) and skipping samples "
            f"[{window[0]}, {window[1]}) (rollback {t.stability.rollbacks} of {cfg.stability.max_rollbacks})",
        )
        t.experts.reset()
        t.loader_iter = t.data_iterator()
        t.rolled_back = True
        return None


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
