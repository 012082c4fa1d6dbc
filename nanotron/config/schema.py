"""Config schema: the single source of truth for a run. One dataclass field = one key, with its default,
help text, choices and lower bound; `--help`, the launcher's flags and the validation all read them here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nanotron.config.engines import PP_ENGINES, PipelineEngine
from nanotron.config.evaluation import EvalTaskConfig, EvaluationConfig
from nanotron.config.model import PRESET_COMMON, PRESETS, ModelConfig, MoEConfig, MupBase, _opt

__all__ = [
    "PP_ENGINES",
    "PRESET_COMMON",
    "PRESETS",
    "EvalTaskConfig",
    "EvaluationConfig",
    "ModelConfig",
    "MoEConfig",
    "MupBase",
    "PipelineEngine",
]


@dataclass
class JobConfig:
    name: str = _opt("tiny", "run name; the run dir is <out_dir>/<name>")
    out_dir: str = _opt("runs", "parent folder of run dirs")
    seed: int = _opt(42, "seeds weight init, data order and dropout-free training RNG", min=0)


RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass
class ParallelismConfig:
    dp: int = _opt(1, "data-parallel degree (replicas x shards)", min=1)
    dp_shard: int = _opt(
        0,
        "FSDP group size: ranks that share one sharded copy of the model (tp, then dp_shard, are the innermost "
        "mesh dims: keep tp*dp_shard within a node); dp/dp_shard such groups replicate it and all-reduce "
        "gradients (HSDP); 0 = dp (plain FSDP); needs zero_stage >= 1",
        min=0,
    )
    tp: int = _opt(1, "tensor-parallel degree (innermost mesh dim)", min=1)
    cp: int = _opt(
        1,
        "context-parallel degree: each sequence split over cp ranks (zigzag chunks, ring attention; the mesh "
        "dim next to tp); FSDP shards over dp x cp; training.seq_len must be divisible by 2*cp",
        min=1,
    )
    ep: int = _opt(
        1,
        "expert-parallel degree (MoE): each MoE layer's experts split over ep ranks carved out of dp x cp (ep "
        "divides dp x cp, it adds no ranks); tokens reach their experts by all-to-all; expert weights are "
        "FSDP-sharded over the remaining dp x cp / ep ranks",
        min=1,
    )
    pp: int = _opt(1, "pipeline-parallel degree", min=1)
    pp_engine: str = _opt("1f1b", "pipeline schedule", tuple(PP_ENGINES))
    pp_stages_per_rank: int = _opt(2, "virtual stages per rank for interleaved_1f1b/zero_bubble", min=1)
    tp_mode: str = _opt(
        "reduce_scatter",
        "all_reduce (Megatron TP) or reduce_scatter (sequence parallel)",
        ("all_reduce", "reduce_scatter"),
    )
    tp_linear_async_communication: bool = _opt(False, "async TP (CUDA, training.compile, tp_mode=reduce_scatter)")
    zero_stage: int = _opt(
        0,
        "0 replicate (DDP); 1 shard params + optimizer state, reduce gradients once per step; 2 also "
        "reduce-scatter gradients every microbatch (keep only the shard); 3 also free params after forward",
        (0, 1, 2, 3),
    )
    recompute: str = _opt(
        "none",
        "activation checkpointing of decoder layers: none; full (keep each layer's input, rerun its forward in "
        "backward); selective (keep matmul, attention and reduce-scatter outputs, rerun the norms, RoPE, SwiGLU's "
        "element-wise ops and the sequence all-gathers)",
        RECOMPUTE_MODES,
    )
    selective_matmuls: str = _opt(
        "all",
        "which matmul outputs recompute='selective' keeps in each layer: all; or every_other (the 1st, 3rd, 5th and "
        "7th of the layer's forward: q, v, gate and down kept, k, o and up rerun in backward; torchtitan's op-level "
        "policy: less memory for 3 more matmuls per layer); the other recompute modes ignore it",
        ("all", "every_other"),
    )
    recompute_every: int = _opt(
        1, "apply parallelism.recompute to every k-th decoder layer (layers 0, k, 2k, ...); the others keep all", min=1
    )

    def recompute_of(self, layer: int) -> str:
        """How decoder layer `layer` (global index) is checkpointed: 'none', 'full' or 'selective'."""
        return self.recompute if layer % self.recompute_every == 0 else "none"


@dataclass
class TrainingConfig:
    steps: int = _opt(300, "optimizer steps", min=1)
    micro_batch_size: int = _opt(8, "samples per microbatch per data-parallel rank", min=1)
    grad_accum_steps: int = _opt(
        1, "microbatches per step per dp rank (= pipeline microbatches); 0 derives it from global_batch_size", min=0
    )
    global_batch_size: int = _opt(
        0, "samples per optimizer step across all ranks; 0 = micro_batch_size * grad_accum_steps * dp", min=0
    )
    seq_len: int = _opt(128, "tokens per sample", min=1)
    dtype: str = _opt(
        "float32",
        "compute dtype (bfloat16: FSDP mixed precision, bf16 compute with fp32 master weights and reductions)",
        ("float32", "bfloat16"),
    )
    clip_grad: float = _opt(1.0, "max global grad norm; 0 disables clipping", min=0.0)
    max_skipped_steps: int = _opt(
        0, "steps with a non-finite loss or gradient skipped (not applied) before the run stops", min=0
    )
    eval_interval: int = _opt(50, "steps between validation passes; 0 disables", min=0)
    eval_steps: int = _opt(4, "global batches per validation pass", min=1)
    compile: bool = _opt(False, "torch.compile each decoder layer")
    tf32: bool = _opt(True, "on CUDA, float32 matmuls on TF32 tensor cores (MFU vs the TF32 peak); false = full fp32")
    device: str = _opt("auto", "auto (cuda if available), cuda or cpu", ("auto", "cuda", "cpu"))
    preflight: bool = _opt(
        False,
        "run nanotron doctor's checks (compute, links, checkpoint disk, clocks) before step 1; bad nodes stop "
        "the job with exit code 75",
    )


@dataclass
class OptimizerConfig:
    lr: float = _opt(3e-3, "peak learning rate", min=0.0)
    min_lr: float = _opt(3e-4, "learning rate at the end of decay", min=0.0)
    warmup_steps: int = _opt(20, "linear warmup steps", min=0)
    decay_style: str = _opt("cosine", "decay after warmup", ("cosine", "linear", "1-sqrt", "constant"))
    decay_steps: int = _opt(0, "steps of decay after warmup; 0 = until training.steps", min=0)
    weight_decay: float = _opt(0.1, "AdamW weight decay (not applied to norms and embeddings)", min=0.0)
    weight_decay_mode: str = _opt(
        "coupled",
        "µP: coupled (AdamW's lr x weight_decay with each matrix's µP LR, so wider matrices decay less per step) "
        "or independent (weight_decay x each matrix's width LR divisor, so lr x weight_decay does not shrink "
        "with width: microsoft/mup's MuAdam and CompleteP's reference code)",
        ("coupled", "independent"),
    )
    betas: list[float] = _opt([0.9, 0.95], "AdamW betas")
    eps: float = _opt(1e-8, "AdamW epsilon", min=0.0)
    eps_mode: str = _opt(
        "scaled",
        "µP: scaled (CompleteP's rule: eps / m for the embedding, head and final norm, eps / (m r^alpha) for "
        "each layer's parameters, following their gradients' scale) or fixed (eps everywhere)",
        ("scaled", "fixed"),
    )
    fused: bool = _opt(True, "fused AdamW kernel where the device has one")


@dataclass
class DatasetConfig:
    """One `[[data.datasets]]` table; on the command line `--data.datasets=PATH:WEIGHT,PATH:WEIGHT`."""

    path: str = _opt("", "a `nanotron tokenize` output dir")
    weight: float = _opt(1.0, "share of the training samples, relative to the other datasets' weights (> 0)")

    @staticmethod
    def from_text(text: str) -> dict[str, str]:
        path, colon, weight = text.rpartition(":")
        return {"path": path, "weight": weight} if colon else {"path": text}


@dataclass
class DataConfig:
    path: str = _opt("data/tokenized/shakespeare", "a `nanotron tokenize` output dir")
    datasets: list[DatasetConfig] = _opt(
        [], "weighted blend of datasets, [[data.datasets]] tables with path and weight; when given, replaces path"
    )
    tokenizer: str = _opt("data/tokenizer", "tokenizer.json file or Hugging Face tokenizer dir")
    num_workers: int = _opt(0, "DataLoader worker processes per rank", min=0)
    skip_samples: list[str] = _opt(
        [],
        "windows of the global sample order never trained on, START:END (end excluded), e.g. 4096:8192; rollbacks "
        "add theirs to <run dir>/skipped_samples.json",
    )


@dataclass
class DistributedConfig:
    timeout_minutes: float = _opt(
        30.0, "a collective waiting longer than this fails the job (NCCL watchdog, gloo), once training runs", min=0.1
    )
    startup_timeout_minutes: float = _opt(
        120.0,
        "the same limit until the first step is done: checkpoint loading, compilation and the first step's "
        "collectives may keep the other ranks waiting that long",
        min=0.1,
    )


@dataclass
class CheckpointConfig:
    dir: str = _opt("", "checkpoint folder; empty = <run dir>/checkpoints")
    interval: int = _opt(0, "steps between checkpoints; 0 = only the final one", min=0)
    save_initial_state: bool = _opt(False, "also save step-0 before training")
    save_final: bool = _opt(True, "save when training ends")
    keep_last: int = _opt(0, "keep only the newest N checkpoints; 0 keeps all", min=0)
    resume_from: str = _opt("auto", "auto (latest in dir if any), latest, none, or a step-N path")
    async_save: bool = _opt(False, "write checkpoints in the background (dcp.async_save)")
    init_from: str = _opt("", "checkpoint dir whose model weights start a new run (e.g. from-hf import)")
    allow_unverified: bool = _opt(
        False,
        "load a checkpoint that has no checksums.json (older versions, hand-made, or the file deleted): its files "
        "are then not checked for corruption",
    )
    allow_global_batch_size_change: bool = _opt(
        False, "let a resume change training.global_batch_size (the data position then shifts; refused otherwise)"
    )


@dataclass
class LoggingConfig:
    log_interval: int = _opt(10, "steps between log lines", min=1)
    tensorboard: bool = _opt(True, "write TensorBoard scalars to the run dir")
    peak_tflops: float = _opt(0.0, "per-device peak for MFU; 0 = detect (GPU table, CPU matmul probe)", min=0.0)
    activation_stats_interval: int = _opt(
        0, "steps between activation statistics (mean |x| per layer output, act/* metrics); 0 disables", min=0
    )
    wandb: bool = _opt(False, "also send every metrics record to Weights & Biases (pip install '.[wandb]')")
    # Empty W&B keys leave the choice to W&B's own environment variables, as a cluster's users expect.
    wandb_project: str = _opt("", "W&B project; empty = $WANDB_PROJECT, else 'nanotron'")
    wandb_entity: str = _opt("", "W&B entity (team or user); empty = $WANDB_ENTITY, else your default")
    wandb_group: str = _opt("", "W&B group, e.g. a sweep's name; empty = $WANDB_RUN_GROUP, else none")
    wandb_mode: str = _opt(
        "",
        "online, offline (no network; `wandb sync` uploads later) or disabled; empty = $WANDB_MODE, else online",
        ("", "online", "offline", "disabled"),
    )


@dataclass
class WatchConfig:
    enabled: bool = _opt(
        True, "heartbeats for the node's watcher process (runs under nanotron's launcher: --nproc_per_node, Slurm)"
    )
    factor: float = _opt(4.0, "a phase is a hang after factor x the longest time any rank spent in it so far", min=1.0)
    floor_seconds: float = _opt(60.0, "the smallest hang limit of a phase already seen", min=0.1)
    unseen_phase_seconds: float = _opt(
        600.0, "hang limit of a phase not seen yet in this run (the first checkpoint save or evaluation)", min=0.1
    )
    startup_seconds: float = _opt(
        1800.0, "hang limit before the first step (data, model build, checkpoint load)", min=1
    )
    straggler_interval: int = _opt(
        50, "steps between straggler scores (one all-gather of 2 floats per rank); 0 disables", min=0
    )
    straggler_threshold: float = _opt(
        0.25, "a rank arriving later than this fraction of a step at the step's collective is late", min=0.0
    )
    straggler_patience: int = _opt(3, "intervals in a row a rank must be late before it is named", min=1)
    straggler_action: str = _opt(
        "warn", "on a persistent straggler: warn, or exclude (stop with the node-fault exit code)", ("warn", "exclude")
    )
    on_hang: str = _opt(
        "requeue",
        "after a hang: requeue (exit code 75; launch/slurm.sh requeues without the suspect nodes) or restart (the "
        "launcher restarts the ranks in place, on the same nodes: for transient faults)",
        ("requeue", "restart"),
    )
    max_restarts_without_progress: int = _opt(
        3, "stop requeueing or restarting after this many node faults in a row without a new checkpoint", min=1
    )


@dataclass
class StabilityConfig:
    """[stability]: finite loss and gradient-norm spikes, decided from the step's agreed values."""

    enabled: bool = _opt(True, "detect loss and gradient-norm spikes (z-score against a running forecast of each)")
    warmup_steps: int = _opt(
        100, "steps observed before the first decision (the running statistics travel with checkpoints)", min=1
    )
    ema_decay: float = _opt(
        0.98, "decay of the running forecast and error variance per step (~1/(1-decay) steps of memory)"
    )
    loss_z: float = _opt(
        6.0, "a loss this many standard deviations above its log-space forecast is a spike; 0 = ignore it", min=0.0
    )
    grad_norm_z: float = _opt(
        8.0, "a gradient norm this many standard deviations above its forecast is a spike; 0 = ignore it", min=0.0
    )
    action: str = _opt(
        "rollback",
        "on a spike the replay reproduces: rollback (reload the newest checkpoint before it, skip the samples of "
        "window_steps steps, go on), skip_step (don't apply the update), stop (exit code 4) or warn",
        ("rollback", "skip_step", "stop", "warn"),
    )
    replay: bool = _opt(
        True, "recompute a spiking step from the same state and batch to tell a faulty rank from bad data"
    )
    replay_tolerance: float = _opt(
        1e-3, "relative difference between the two passes' loss or gradient norm that marks a transient fault", min=0.0
    )
    on_transient: str = _opt(
        "stop",
        "when the replay differs: stop (exit code 75, the named ranks' nodes in suspect_nodes.txt) or continue "
        "with the replayed step",
        ("stop", "continue"),
    )
    window_steps: int = _opt(1, "rollback: steps of samples skipped, ending with the spiking step's", min=1)
    max_rollbacks: int = _opt(3, "rollbacks in one run before it stops (exit code 4): spikes that keep coming", min=1)


@dataclass
class ProfilerConfig:
    export_path: str = _opt("", "folder for torch.profiler traces; empty disables")
    wait_steps: int = _opt(2, "steps skipped before profiling", min=0)
    active_steps: int = _opt(3, "steps recorded", min=1)


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.job.out_dir) / self.job.name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    @property
    def world_size(self) -> int:
        p = self.parallelism
        return p.dp * p.cp * p.tp * p.pp

    @property
    def dp_shard_size(self) -> int:
        """Ranks in one FSDP group: parallelism.dp_shard, or all of dp when it is 0 (1 under zero_stage 0)."""
        p = self.parallelism
        return 1 if p.zero_stage == 0 else p.dp_shard or p.dp

    @property
    def fsdp_shard_size(self) -> int:
        """Ranks one FSDP group shards parameters over: the dp_shard group times cp (cp ranks hold the same
        parameters and shard them together); 1 under zero_stage 0 (replicas)."""
        return 1 if self.parallelism.zero_stage == 0 else self.dp_shard_size * self.parallelism.cp

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp, times pp_stages_per_rank for multi-stage engines."""
        p = self.parallelism
        return p.pp * PP_ENGINES[p.pp_engine].stages_per_rank(p.pp_stages_per_rank)

    def to_dict(self) -> dict[str, Any]:
        return {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in asdict(self).items()}
