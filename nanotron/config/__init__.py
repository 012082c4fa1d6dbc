"""The run config: the root `Config` (`schema.py`) and one module per concept for its sections, TOML and overrides
(`parse.py`), cross-field checks (`validate.py`)."""

from nanotron.config.data import DataConfig, DatasetConfig
from nanotron.config.engines import PP_ENGINES, PipelineEngine
from nanotron.config.evaluation import EvalTaskConfig, EvaluationConfig
from nanotron.config.model import PRESETS, ModelConfig, MoEConfig, MupBase
from nanotron.config.parallelism import RECOMPUTE_MODES, DistributedConfig, ParallelismConfig
from nanotron.config.parse import help_text, load_config, parse_overrides, read_model_config, to_toml, toml_text
from nanotron.config.resilience import StabilityConfig, WatchConfig
from nanotron.config.run import CheckpointConfig, JobConfig, LoggingConfig, ProfilerConfig
from nanotron.config.schema import Config
from nanotron.config.training import OptimizerConfig, TrainingConfig
from nanotron.config.validate import validate

__all__ = [
    "PP_ENGINES",
    "PRESETS",
    "RECOMPUTE_MODES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DatasetConfig",
    "DistributedConfig",
    "EvalTaskConfig",
    "EvaluationConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEConfig",
    "MupBase",
    "OptimizerConfig",
    "ParallelismConfig",
    "PipelineEngine",
    "ProfilerConfig",
    "StabilityConfig",
    "TrainingConfig",
    "WatchConfig",
    "help_text",
    "load_config",
    "parse_overrides",
    "read_model_config",
    "to_toml",
    "toml_text",
    "validate",
]
