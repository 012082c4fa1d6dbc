"""The run config: schema (`schema.py`), TOML and overrides (`parse.py`), cross-field checks (`validate.py`)."""

from nanotron.config.parse import help_text, load_config, parse_overrides, read_model_config, to_toml, toml_text
from nanotron.config.schema import (
    PP_ENGINES,
    PRESETS,
    CheckpointConfig,
    Config,
    DataConfig,
    DatasetConfig,
    DistributedConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PipelineEngine,
    ProfilerConfig,
    TrainingConfig,
    WatchConfig,
)
from nanotron.config.validate import validate

__all__ = [
    "PP_ENGINES",
    "PRESETS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DatasetConfig",
    "DistributedConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PipelineEngine",
    "ProfilerConfig",
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
