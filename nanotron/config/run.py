"""What a run is called and what it writes: [job] (name, run dir, seed), [checkpoint], [logging] (console,
metrics, TensorBoard, W&B) and [profiler]."""

from __future__ import annotations

from dataclasses import dataclass

from nanotron.config.option import opt


@dataclass
class JobConfig:
    name: str = opt("tiny", "run name; the run dir is <out_dir>/<name>")
    out_dir: str = opt("runs", "parent folder of run dirs")
    seed: int = opt(42, "seeds weight init, data order and dropout-free training RNG", min=0)


@dataclass
class CheckpointConfig:
    dir: str = opt("", "checkpoint folder; empty = <run dir>/checkpoints")
    interval: int = opt(0, "steps between checkpoints; 0 = only the final one", min=0)
    save_initial_state: bool = opt(False, "also save step-0 before training")
    save_final: bool = opt(True, "save when training ends")
    keep_last: int = opt(0, "keep only the newest N checkpoints; 0 keeps all", min=0)
    resume_from: str = opt("auto", "auto (latest in dir if any), latest, none, or a step-N path")
    async_mode: str = opt(
        "sync",
        "sync (training waits for the write), async (dcp.async_save: training waits only for the copy to host "
        "memory, the write runs in the background) or async_pinned (async, staged in pinned host memory so the "
        "device-to-host copy overlaps training; CUDA only)",
        ("sync", "async", "async_pinned"),
    )
    init_from: str = opt("", "checkpoint dir whose model weights start a new run (e.g. from-hf import)")
    reset_optimizer: bool = opt(
        False,
        "resume the weights and progress but start the optimizer state afresh (required to change "
        "optimizer.name: AdamW's moments and Muon's momentum are not each other's)",
    )
    allow_unverified: bool = opt(
        False,
        "load a checkpoint that has no checksums.json (older versions, hand-made, or the file deleted): its files "
        "are then not checked for corruption",
    )
    allow_global_batch_size_change: bool = opt(
        False, "let a resume change training.global_batch_size (the data position then shifts; refused otherwise)"
    )


@dataclass
class LoggingConfig:
    log_interval: int = opt(10, "steps between log lines", min=1)
    tensorboard: bool = opt(True, "write TensorBoard scalars to the run dir")
    peak_tflops: float = opt(0.0, "per-device peak for MFU; 0 = detect (GPU table, CPU matmul probe)", min=0.0)
    activation_stats_interval: int = opt(
        0, "steps between activation statistics (mean |x| per layer output, act/* metrics); 0 disables", min=0
    )
    wandb: bool = opt(False, "also send every metrics record to Weights & Biases (pip install '.[wandb]')")
    # Empty W&B keys leave the choice to W&B's own environment variables, as a cluster's users expect.
    wandb_project: str = opt("", "W&B project; empty = $WANDB_PROJECT, else 'nanotron'")
    wandb_entity: str = opt("", "W&B entity (team or user); empty = $WANDB_ENTITY, else your default")
    wandb_group: str = opt("", "W&B group, e.g. a sweep's name; empty = $WANDB_RUN_GROUP, else none")
    wandb_mode: str = opt(
        "",
        "online, offline (no network; `wandb sync` uploads later) or disabled; empty = $WANDB_MODE, else online",
        ("", "online", "offline", "disabled"),
    )


@dataclass
class ProfilerConfig:
    export_path: str = opt("", "folder for torch.profiler traces; empty disables")
    wait_steps: int = opt(2, "steps skipped before profiling", min=0)
    active_steps: int = opt(3, "steps recorded", min=1)
