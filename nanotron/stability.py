"""Finite loss spikes: detected from the values every rank agrees on, replayed to tell a faulty rank from bad
data, then handled by policy (roll back past the samples, skip the update, stop, or warn).

The detector keeps an exponentially smoothed forecast (level and trend of the logarithm) of the loss and of the
gradient norm, with the variance of its errors, and a running mean of each; it scores each step twice: by its
z-score against the forecast (the error over the curve's own noise) and by its ratio to the running mean. It sees
only the step's agreed values (the all-reduce every step already does), so every rank takes the same decision at
no extra collective and no host sync beyond that one: a few float operations per step, whatever the run's length.
Its statistics, the skipped sample windows and the rollback count travel in every checkpoint's trainer_state.json,
so a resumed run is not blind for a warm-up. The policy is a decision from values
(`Stability.decide(Observation) -> Decision`); the replay, the checkpoint reload and the data reset it asks for
are the trainer's to carry out.
The idea of replaying a suspicious step to separate a transient fault from a reproducible one is Megatron-LM's
rerun state machine (`megatron/core/rerun_state_machine.py`); spotting spikes and the rollback-and-skip remedy
are what the PaLM (Chowdhery et al. 2022, §5.1) and OPT logbooks describe doing by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from nanotron.checkpoint.layout import step_of
from nanotron.config import Config, StabilityConfig
from nanotron.data.skips import SKIPPED_SAMPLES, SampleSkips, read_run_skips
from nanotron.errors import ConfigError, NodeFaultError, SpikeError, UserError

# The standard deviation a z-score divides by is at least this much (in log space: a 1% change): a flat curve
# (variance ~0) must not turn rounding noise into spikes.
STD_FLOOR = 0.01
SIGNALS = ("loss", "grad_norm")
# A step's scores, each named as the [stability] key of its threshold: a signal's z-score against its forecast, and
# its ratio to its running geometric mean. The z rule is the spike score of OLMo 2's report (deviations counted in
# rolling standard deviations); the ratio rule is what MosaicML's KillLossSpike (a loss above a multiple of its
# rolling mean) and Megatron-LM's rerun state machine (a loss or gradient norm above 10x the largest value seen)
# test. Small-batch noise inflates the standard deviation the z rule divides by, so that a 40% jump scores z 3; the
# ratio rule does not divide by it. Its reference is a plain running mean, neither the z rule's forecast (whose slow
# trend, learnt while the loss fell, still extrapolates a fall after the curve flattens: a clean plateau then looks
# 10-20% above it) nor a running maximum (which a ramp over a few steps raises with every step it accepts: the mean
# moves by 1 - ema_decay of the step's log-ratio).
RULES = ("loss_z", "grad_norm_z", "loss_ratio", "grad_norm_ratio")


@dataclass
class RunningStats:
    """One signal's running forecast: level and trend of its logarithm (Holt's linear exponential smoothing, in
    error-correction form, with gains 1 - decay and (1 - decay)^2) and the exponentially weighted variance of the
    one-step forecast errors; and the exponentially weighted mean of its logarithm (`mean`: the log of the running
    geometric mean). Log space makes a spike a ratio (5x is 5x at any loss); the trend keeps a loss that falls
    steadily from looking like a series of negative surprises whose variance would then hide a real jump."""

    level: float = 0.0
    trend: float = 0.0
    var: float = 0.0
    mean: float = 0.0

    def z(self, value: float) -> float:
        return (_log(value) - self.level - self.trend) / max(math.sqrt(self.var), STD_FLOOR)

    def ratio(self, value: float) -> float:
        """`value` over the running geometric mean."""
        return math.exp(min(_log(value) - self.mean, MAX_LOG_RATIO))

    def rebase(self, value: float) -> None:
        """`value` becomes the level and the mean, with no trend; the forecast errors' variance (the noise scale)
        stays."""
        self.level, self.trend, self.mean = _log(value), 0.0, _log(value)

    def update(self, value: float, decay: float, first: bool) -> None:
        if first:
            self.level, self.trend, self.var, self.mean = _log(value), 0.0, 0.0, _log(value)
            return
        gain = 1 - decay
        error = _log(value) - self.level - self.trend
        self.level += self.trend + gain * error
        self.trend += gain * gain * error
        self.var = decay * self.var + gain * error * error
        self.mean += gain * (_log(value) - self.mean)


def _log(value: float) -> float:
    return math.log(max(value, 1e-30))


MAX_LOG_RATIO = 700.0  # exp() of more overflows a float: a ratio of e^700 is a spike whatever the threshold


class SpikeDetector:
    """Each signal's z-score against its forecast and ratio to its mean (`RULES`); a spike after warm_up steps."""

    def __init__(self, cfg: StabilityConfig) -> None:
        self.cfg = cfg
        self.observed = 0
        self.stats = {name: RunningStats() for name in SIGNALS}
        self.worst = {rule: 0.0 for rule in RULES}  # each score's largest after warm-up (how close a run came)

    def scores(self, loss: float, grad_norm: float) -> dict[str, float]:
        """The step's score by each rule (all 0 before a first step to compare with)."""
        if not self.observed:
            return {rule: 0.0 for rule in RULES}
        values = dict(zip(SIGNALS, (loss, grad_norm)))
        z = {f"{name}_z": self.stats[name].z(values[name]) for name in SIGNALS}
        return z | {f"{name}_ratio": self.stats[name].ratio(values[name]) for name in SIGNALS}

    def fired(self, scores: dict[str, float]) -> list[str]:
        """The rules whose threshold (a [stability] key of the same name; 0 = off) the scores exceed."""
        if not self.cfg.enabled or self.observed < self.cfg.warmup_steps:
            return []
        return [rule for rule in RULES if 0 < getattr(self.cfg, rule) < scores[rule]]

    def is_spike(self, scores: dict[str, float]) -> bool:
        return bool(self.fired(scores))

    def observe(self, loss: float, grad_norm: float) -> None:
        """An applied step's values join the running statistics (a spike's never do, unless only warned of)."""
        scores = self.scores(loss, grad_norm)
        if self.observed >= self.cfg.warmup_steps:
            self.worst = {rule: max(self.worst[rule], scores[rule]) for rule in RULES}
        for name, value in zip(SIGNALS, (loss, grad_norm)):
            self.stats[name].update(value, self.cfg.ema_decay, first=self.observed == 0)
        self.observed += 1

    def rebase(self, loss: float, grad_norm: float) -> None:
        """The signals moved to a new level and stayed (`Stability.max_skips`): these values are the statistics'
        level from now on."""
        for name, value in zip(SIGNALS, (loss, grad_norm)):
            self.stats[name].rebase(value)
        self.observed += 1

    def state_dict(self) -> dict:
        return {
            "observed": self.observed,
            "stats": {name: [s.level, s.trend, s.var] for name, s in self.stats.items()},
            "mean": {name: s.mean for name, s in self.stats.items()},
            "max_z": {name: self.worst[f"{name}_z"] for name in SIGNALS},
            "max_ratio": {name: self.worst[f"{name}_ratio"] for name in SIGNALS},
        }

    def load_state_dict(self, state: dict) -> None:
        """`state` as checked by `records.TRAINER_STATE`: finite statistics, a variance >= 0. A checkpoint saved
        before the ratio rule has no running mean: its forecast's level (the smoothed log value, the nearest thing
        it holds) stands in, and its largest ratios count from this start."""
        self.observed = state["observed"]
        means = state.get("mean") or {name: state["stats"][name][0] for name in SIGNALS}
        self.stats = {name: RunningStats(*state["stats"][name], mean=means[name]) for name in SIGNALS}
        max_ratio = state.get("max_ratio") or {name: 0.0 for name in SIGNALS}
        self.worst = {f"{name}_z": state["max_z"][name] for name in SIGNALS}
        self.worst |= {f"{name}_ratio": max_ratio[name] for name in SIGNALS}


@dataclass(frozen=True)
class Replay:
    """A spiking step recomputed from the same state and batch: its global loss and gradient norm, every rank's own
    [loss, squared gradient norm] of the first pass and then of the replay (`rank_values`), and each rank's node."""

    loss: float
    grad_norm: float
    rank_values: list[list[float]]
    nodes: list[str]


@dataclass(frozen=True)
class Observation:
    """A finite step as every rank agrees on it (its global loss and gradient norm), and what the trainer found out
    when the policy asked: the step's replay, the committed checkpoints (None: not asked yet)."""

    step: int
    loss: float
    grad_norm: float
    replay: Replay | None = None
    checkpoints: list[Path] | None = None


@dataclass(frozen=True)
class Decision:
    """What the trainer does with a step: "apply" its update, "skip" it, "rollback" to `target` or "stop" with
    `error`, logging `event` with `line` first (a rollback's line is completed by `Stability.rolled_back`); or a
    question, "replay" or "checkpoints", that the trainer answers in the next Observation."""

    action: str
    event: dict | None = None
    line: str | None = None
    error: UserError | None = None
    target: Path | None = None


class Stability:
    """What a run knows about its spikes, saved with its progress: the detector, the skipped windows (the config's,
    the run dir's and the checkpoint's, united) and the rollbacks so far; and the policy that decides on each step
    from them. It holds no part of the trainer: the replay, the checkpoint reload and the data reset are the
    trainer's, carried out on its decisions."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg.stability
        self.global_batch_size = cfg.training.global_batch_size
        self.detector = SpikeDetector(cfg.stability)
        # The windows this start adds to those a checkpoint holds, by where they come from.
        self.added = {"data.skip_samples": SampleSkips.parse(cfg.data.skip_samples)}
        self.added[str(cfg.run_dir / SKIPPED_SAMPLES)] = read_run_skips(cfg.run_dir)
        self.skips = SampleSkips()
        for skips in self.added.values():
            self.skips.update(skips)
        self.rollbacks = 0
        self.skips_in_a_row = 0  # updates skipped since the last applied one
        self.last_scores: dict[str, float] = {rule: 0.0 for rule in RULES}

    def state_dict(self) -> dict:
        return {
            "detector": self.detector.state_dict(),
            "skipped_samples": self.skips.to_list(),
            "rollbacks": self.rollbacks,
            "skips_in_a_row": self.skips_in_a_row,
        }

    def load_state_dict(self, state: dict | None, where: str, consumed_samples: int) -> None:
        """A checkpoint's state (checked by `records.TRAINER_STATE`), which had trained `consumed_samples`. Windows
        and rollbacks only grow: a rollback loads an older checkpoint than what the run already knows."""
        saved = SampleSkips(state["skipped_samples"]) if state is not None else SampleSkips()
        self._check_added_windows(saved, where, consumed_samples)
        self.skips.update(saved)
        if state is None:  # saved before stability existed: start observing afresh
            return
        self.detector.load_state_dict(state["detector"])
        self.rollbacks = max(self.rollbacks, state["rollbacks"])
        self.skips_in_a_row = state.get("skips_in_a_row") or 0  # absent from checkpoints saved before max_skips

    def _check_added_windows(self, saved: SampleSkips, where: str, consumed_samples: int) -> None:
        """A window that the checkpoint did not skip may only lie ahead of the data position it trained to: one
        behind it would move the positions of samples already trained, so that the next steps skip other samples,
        which nobody named."""
        if not consumed_samples:
            return
        last = saved.position(consumed_samples - 1)
        for source, skips in self.added.items():
            for start, end in skips.windows:
                if SampleSkips([*saved.windows, (start, end)]).position(consumed_samples - 1) != last:
                    raise ConfigError(
                        f"{source}: window {start}:{end} lies behind the data position {last + 1} that {where} has "
                        f"trained to ({consumed_samples} samples): skipping it now would shift the data order and "
                        f"skip other, unnamed samples; give windows that start at or after {last + 1}, or resume from "
                        "a checkpoint before the window"
                    )

    def window(self, first_sample: int, global_batch_size: int, floor_sample: int) -> tuple[int, int]:
        """The data positions a rollback skips: those of the window_steps steps ending with the one that starts at
        trained sample `first_sample`, never before the rollback target's position (trained sample `floor_sample`)."""
        start = max(first_sample - (self.cfg.window_steps - 1) * global_batch_size, floor_sample)
        return self.skips.position(start), self.skips.position(first_sample + global_batch_size - 1) + 1

    def decide(self, seen: Observation) -> Decision:
        """`_decide`, counting the updates skipped in a row (stability.max_skips)."""
        decision = self._decide(seen)
        if decision.action in ("apply", "skip"):
            self.skips_in_a_row = self.skips_in_a_row + 1 if decision.action == "skip" else 0
        return decision

    def _decide(self, seen: Observation) -> Decision:
        """The step scored against the running forecast (every rank holds the same values: one decision for the
        job). A spike asks for a replay (stability.replay), then, under rollback, for the committed checkpoints; the
        detector moves only with a final decision, so asking again with the answers scores the same step."""
        scores = self.last_scores = self.detector.scores(seen.loss, seen.grad_norm)
        rules = self.detector.fired(scores)
        if not rules:
            self.detector.observe(seen.loss, seen.grad_norm)
            return Decision("apply")
        event = {"step": seen.step, "stability/loss": seen.loss, "stability/grad_norm": seen.grad_norm}
        event |= {f"stability/{rule}": score for rule, score in scores.items()} | {"stability/rules": rules}
        over = ", ".join(f"stability.{rule}={getattr(self.cfg, rule):g}" for rule in rules)
        what = (
            f"stability: step {seen.step} spiked (loss {seen.loss:.4g}, z {scores['loss_z']:.1f}, "
            f"{scores['loss_ratio']:.2f}x its mean; grad_norm {seen.grad_norm:.4g}, z {scores['grad_norm_z']:.1f}, "
            f"{scores['grad_norm_ratio']:.2f}x its mean; over {over})"
        )
        if self.cfg.replay:
            if seen.replay is None:
                return Decision("replay")
            if (transient := self._transient(seen, event, what)) is not None:
                return transient
            what += "; the replay reproduced it (the data or the optimisation, not a rank)"
        return self._act(seen, event, what)

    def _transient(self, seen: Observation, event: dict, what: str) -> Decision | None:
        """A replay that differs (on some rank, or in the global values) shows a transient fault: the replayed step
        is the clean one. None if it reproduced the step within replay_tolerance."""
        replay, tolerance = seen.replay, self.cfg.replay_tolerance
        rows = replay.rank_values
        ranks, changed = differing_ranks([r[:2] for r in rows], [r[2:] for r in rows], tolerance)
        first, second = (seen.loss, seen.grad_norm), (replay.loss, replay.grad_norm)
        if not ranks and not any(differs(a, b, tolerance) for a, b in zip(first, second)):
            return None
        event |= {"stability/action": "transient", "stability/ranks": ranks}
        named = ", ".join(f"rank {r} (node {replay.nodes[r]})" for r in ranks) or "no single rank"
        line = (
            f"{what}; the replay gave loss {replay.loss:.4g}, grad_norm {replay.grad_norm:.4g}: a transient fault, "
            f"{changed or 'nothing rank-local'} differed on {named}"
        )
        if self.cfg.on_transient == "stop":
            message = f"{line}; stopped to requeue without its node (stability.on_transient)"
            error = NodeFaultError(message, sorted({replay.nodes[r] for r in ranks}))
            return Decision("stop", event | {"stability/action": "exclude"}, line, error)
        self.detector.observe(replay.loss, replay.grad_norm)
        return Decision("apply", event, f"{line}; going on with the replayed step (stability.on_transient)")

    def _act(self, seen: Observation, event: dict, what: str) -> Decision:
        """stability.action on a spike the replay reproduced (or that was not replayed)."""
        action = self.cfg.action
        if action == "warn":
            self.detector.observe(seen.loss, seen.grad_norm)
            return Decision(
                "apply", event | {"stability/action": "warn"}, f"warning: {what}; applied (stability.action=warn)"
            )
        if action == "stop":
            error = SpikeError(
                f"{what}; stopped before applying it (stability.action=stop): resume from the last checkpoint "
                f"with data.skip_samples covering step {seen.step}'s samples, or a lower optimizer.lr"
            )
            return Decision("stop", event | {"stability/action": "stop"}, error=error)
        if action == "rollback":
            if seen.checkpoints is None:
                return Decision("checkpoints")
            older = [path for path in seen.checkpoints if step_of(path) < seen.step]
            if not older:
                what += f"; no committed checkpoint before step {seen.step} to roll back to (checkpoint.interval)"
            elif self.rollbacks >= self.cfg.max_rollbacks:
                error = SpikeError(
                    f"{what}; stopped: stability.max_rollbacks={self.cfg.max_rollbacks} rollbacks already "
                    f"(windows skipped: {self.skips.to_list()}); inspect the data around these samples, "
                    "lower optimizer.lr or raise stability.max_rollbacks, and resume"
                )
                return Decision("stop", event | {"stability/action": "stop"}, error=error)
            else:
                return Decision("rollback", event, what, target=older[-1])
        if self.skips_in_a_row >= self.cfg.max_skips:
            line = (
                f"warning: {what}; {self.skips_in_a_row} updates skipped in a row: the signals moved to a new level "
                f"and stayed, not a spike (stability.max_skips={self.cfg.max_skips}); that level is the statistics' "
                f"from step {seen.step} on and its update is applied"
            )
            self.detector.rebase(seen.loss, seen.grad_norm)
            return Decision("apply", event | {"stability/action": "rebase"}, line)
        return Decision("skip", event | {"stability/action": "skip_step"}, f"warning: {what}; update skipped")

    def rolled_back(self, decision: Decision, first_sample: int, step: int, floor_sample: int) -> tuple[dict, str]:
        """The trainer loaded `decision.target` (now at `step`, trained sample `floor_sample`) for the spike at
        trained sample `first_sample`: the rollback counts, its window of samples is skipped from now on. Returns
        the event to log and its line."""
        self.rollbacks += 1
        window = self.window(first_sample, self.global_batch_size, floor_sample)
        self.skips.add(*window)
        event = decision.event | {
            "stability/action": "rollback",
            "stability/window": list(window),
            "stability/rollback_to": step,
        }
        line = (
            f"{decision.line}; rolled back to step {step} ({decision.target}) and skipping samples "
            f"[{window[0]}, {window[1]}) (rollback {self.rollbacks} of {self.cfg.max_rollbacks})"
        )
        return event, line


def rank_values(
    loss: torch.Tensor | None, grad_norm: torch.Tensor, params: list[torch.nn.Parameter], clip: float
) -> list[float]:
    """This rank's own loss and the squared norm of its gradient shards before clipping: what a replay compares
    rank by rank."""
    squares = sum(
        (g.to_local() if isinstance(g, DTensor) else g).double().square().sum()
        for g in (p.grad for p in params)
        if g is not None
    )
    coefficient = min(1.0, clip / (grad_norm.item() + 1e-6)) if clip > 0 else 1.0
    return [0.0 if loss is None else loss.item(), float(squares) / coefficient**2]


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
