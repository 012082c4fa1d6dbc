"""The config schema's root: `Config`, one field per section, and what is derived across sections (run dir,
world size, FSDP group, pipeline stages). Each section's keys live in the module of its concept; one dataclass
field = one key (`option.opt`), the single source of truth for `--help`, the launcher's flags and validation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nanotron.config.data import DataConfig
from nanotron.config.engines import PP_ENGINES
from nanotron.config.evaluation import EvaluationConfig
from nanotron.config.model import ModelConfig
from nanotron.config.parallelism import DistributedConfig, ParallelismConfig, fsdp_wraps
from nanotron.config.resilience import StabilityConfig, WatchConfig
from nanotron.config.run import CheckpointConfig, JobConfig, LoggingConfig, ProfilerConfig
from nanotron.config.training import OptimizerConfig, TrainingConfig


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
    def wraps_fsdp(self) -> bool:
        """Whether FSDP2 (replicate under zero_stage 0) wraps the model (`nanotron.parallel.fsdp.apply_fsdp`): not for
        one data-parallel rank (dp x cp) in fp32, where it has nothing to shard, reduce or cast."""
        return fsdp_wraps(self.parallelism.dp * self.parallelism.cp, self.training.dtype)

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
