"""What a run does about faults: [watch] (hangs, stragglers, node faults: requeue or restart) and [stability]
(loss and gradient-norm spikes: replay, rollback, skip, stop)."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron.config.option import opt


@dataclass
class WatchConfig:
    enabled: bool = opt(
        True, "heartbeats for the node's watcher process (runs under nanotron's launcher: --nproc_per_node, Slurm)"
    )
    factor: float = opt(4.0, "a phase is a hang after factor x the longest time any rank spent in it so far", min=1.0)
    floor_seconds: float = opt(60.0, "the smallest hang limit of a phase already seen", min=0.1)
    unseen_phase_seconds: float = opt(
        600.0, "hang limit of a phase not seen yet in this run (the first checkpoint save or evaluation)", min=0.1
    )
    startup_seconds: float = opt(1800.0, "hang limit before the first step (data, model build, checkpoint load)", min=1)
    straggler_interval: int = opt(
        50, "steps between straggler scores (one all-gather of 2 floats per rank); 0 disables", min=0
    )
    straggler_threshold: float = opt(
        0.4,
        "a rank that works longer than its peers between collectives by more than this fraction of their time "
        "is slow (0.4: 1.4x as long)",
        min=0.0,
    )
    straggler_patience: int = opt(3, "intervals in a row a rank must be slow before it is named", min=1)
    straggler_action: str = opt(
        "warn", "on a persistent straggler: warn, or exclude (stop with the node-fault exit code)", ("warn", "exclude")
    )
    on_hang: str = opt(
        "requeue",
        "after a hang: requeue (exit code 75; launch/slurm.sh requeues without the suspect nodes) or restart (the "
        "launcher restarts the ranks in place, on the same nodes: for transient faults)",
        ("requeue", "restart"),
    )
    max_restarts_without_progress: int = opt(
        3, "stop requeueing or restarting after this many node faults in a row without a new checkpoint", min=1
    )


@dataclass
class StabilityConfig:
    """[stability]: finite loss and gradient-norm spikes, decided from the step's agreed values."""

    enabled: bool = opt(
        True, "detect loss and gradient-norm spikes (z-score against a running forecast, ratio to a running mean)"
    )
    warmup_steps: int = opt(
        100, "steps observed before the first decision (the running statistics travel with checkpoints)", min=1
    )
    ema_decay: float = opt(
        0.98, "decay of the running forecast and error variance per step (~1/(1-decay) steps of memory)"
    )
    loss_z: float = opt(
        6.0, "a loss this many standard deviations above its log-space forecast is a spike; 0 = ignore it", min=0.0
    )
    grad_norm_z: float = opt(
        8.0, "a gradient norm this many standard deviations above its forecast is a spike; 0 = ignore it", min=0.0
    )
    loss_ratio: float = opt(
        1.25,
        "a loss above this multiple of its running (geometric) mean is a spike, however noisy the curve (noise "
        "inflates the z-score's standard deviation, not this); 0 = ignore, else > 1",
        min=0.0,
    )
    grad_norm_ratio: float = opt(
        4.0,
        "a gradient norm above this multiple of its running mean is a spike, however noisy; 0 = ignore, else > 1",
        min=0.0,
    )
    action: str = opt(
        "rollback",
        "on a spike the replay reproduces: rollback (reload the newest checkpoint before it, skip the samples of "
        "window_steps steps, go on), skip_step (don't apply the update), stop (exit code 4) or warn",
        ("rollback", "skip_step", "stop", "warn"),
    )
    replay: bool = opt(
        True, "recompute a spiking step from the same state and batch to tell a faulty rank from bad data"
    )
    replay_tolerance: float = opt(
        1e-3, "relative difference between the two passes' loss or gradient norm that marks a transient fault", min=0.0
    )
    on_transient: str = opt(
        "stop",
        "when the replay differs: stop (exit code 75, the named ranks' nodes in suspect_nodes.txt) or continue "
        "with the replayed step",
        ("stop", "continue"),
    )
    window_steps: int = opt(1, "rollback: steps of samples skipped, ending with the spiking step's", min=1)
    max_rollbacks: int = opt(3, "rollbacks in one run before it stops (exit code 4): spikes that keep coming", min=1)
    max_skips: int = opt(
        5,
        "skipped updates in a row (action skip_step, or rollback with no earlier checkpoint) after which the signals' "
        "level is taken to have moved, not spiked: the statistics move to that step's values and its update is applied",
        min=1,
    )
