"""Config schema: the single source of truth for a run.

A run is described by one TOML file plus `--section.key=value` overrides. Every key is a dataclass
field below; anything else is a `ConfigError` naming the key, what was expected and a fix.
"""

from __future__ import annotations

import difflib
import math
import sys
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nanotron.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _opt(default: Any, help: str, choices: tuple | None = None, min: float | None = None) -> Any:
    meta = {"help": help, "choices": choices, "min": min}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobConfig:
    name: str = _opt("tiny", "run name; the run dir is <out_dir>/<name>")
    out_dir: str = _opt("runs", "parent folder of run dirs")
    seed: int = _opt(42, "seeds weight init, data order and dropout-free training RNG", min=0)


@dataclass
class ModelConfig:
    size: str = _opt("tiny", "preset filling the fields left unset", ("tiny", "small", "base", "large"))
    hidden_size: int | None = _opt(None, "model width", min=1)
    intermediate_size: int | None = _opt(None, "SwiGLU hidden width", min=1)
    num_layers: int | None = _opt(None, "decoder layers", min=1)
    num_heads: int | None = _opt(None, "attention (query) heads", min=1)
    num_kv_heads: int | None = _opt(None, "key/value heads (GQA); divides num_heads", min=1)
    vocab_size: int | None = _opt(None, "embedding rows; at least the tokenizer's vocab", min=1)
    max_seq_len: int | None = _opt(None, "longest sequence RoPE is precomputed for", min=1)
    rope_theta: float | None = _opt(None, "RoPE base", min=1.0)
    rms_norm_eps: float | None = _opt(None, "RMSNorm epsilon", min=0.0)
    tie_word_embeddings: bool | None = _opt(None, "share embedding and lm_head weights")
    init_std: float = _opt(0.02, "std of the normal init of linear and embedding weights", min=0.0)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=8192,
        max_seq_len=256,
    ),
    "small": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        vocab_size=32000,
        max_seq_len=2048,
    ),
    "base": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        vocab_size=32000,
        max_seq_len=2048,
    ),
    "large": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        vocab_size=32000,
        max_seq_len=2048,
    ),
}
PRESET_COMMON = dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


@dataclass
class ParallelismConfig:
    dp: int = _opt(1, "data-parallel degree", min=1)
    tp: int = _opt(1, "tensor-parallel degree (innermost mesh dim)", min=1)
    pp: int = _opt(1, "pipeline-parallel degree", min=1)
    pp_engine: str = _opt("1f1b", "pipeline schedule", ("1f1b", "afab", "interleaved_1f1b", "zero_bubble", "zbv"))
    pp_stages_per_rank: int = _opt(2, "virtual stages per rank for interleaved_1f1b/zero_bubble", min=1)
    tp_mode: str = _opt(
        "reduce_scatter",
        "all_reduce (Megatron TP) or reduce_scatter (sequence parallel)",
        ("all_reduce", "reduce_scatter"),
    )
    tp_linear_async_communication: bool = _opt(False, "async TP (needs CUDA + training.compile)")
    zero_stage: int = _opt(
        0, "0 replicate (DDP), 1/2 FSDP keeping params after forward, 3 FSDP resharding", (0, 1, 2, 3)
    )
    recompute_layer: bool = _opt(False, "recompute each decoder layer in backward (activation checkpointing)")


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
    dtype: str = _opt("float32", "compute dtype (bfloat16 = autocast / FSDP mixed precision)", ("float32", "bfloat16"))
    clip_grad: float = _opt(1.0, "max global grad norm; 0 disables clipping", min=0.0)
    eval_interval: int = _opt(50, "steps between validation passes; 0 disables", min=0)
    eval_steps: int = _opt(4, "global batches per validation pass", min=1)
    compile: bool = _opt(False, "torch.compile each decoder layer")
    device: str = _opt("auto", "auto (cuda if available), cuda or cpu", ("auto", "cuda", "cpu"))


@dataclass
class OptimizerConfig:
    lr: float = _opt(3e-3, "peak learning rate", min=0.0)
    min_lr: float = _opt(3e-4, "learning rate at the end of decay", min=0.0)
    warmup_steps: int = _opt(20, "linear warmup steps", min=0)
    decay_style: str = _opt("cosine", "decay after warmup", ("cosine", "linear", "1-sqrt", "constant"))
    decay_steps: int = _opt(0, "steps of decay after warmup; 0 = until training.steps", min=0)
    weight_decay: float = _opt(0.1, "AdamW weight decay (not applied to norms and embeddings)", min=0.0)
    betas: list[float] = _opt([0.9, 0.95], "AdamW betas")
    eps: float = _opt(1e-8, "AdamW epsilon", min=0.0)
    fused: bool = _opt(True, "fused AdamW kernel where the device has one")


@dataclass
class DataConfig:
    path: str = _opt("data/corpus", "local text/jsonl/parquet file or folder, or a hub dataset name")
    text_column: str = _opt("text", "column holding the document text")
    tokenizer: str = _opt("data/tokenizer", "tokenizer.json file or Hugging Face tokenizer dir")
    validation_split: float = _opt(0.05, "fraction of documents held out for validation", min=0.0)
    cache_dir: str = _opt(".cache/nanotron", "where tokenized corpora are cached")
    num_workers: int = _opt(0, "DataLoader worker processes per rank", min=0)


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


@dataclass
class LoggingConfig:
    log_interval: int = _opt(10, "steps between log lines", min=1)
    tensorboard: bool = _opt(True, "write TensorBoard scalars to the run dir")
    peak_tflops: float = _opt(0.0, "per-device peak for MFU; 0 = detect (GPU table, CPU matmul probe)", min=0.0)


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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.job.out_dir) / self.job.name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    @property
    def world_size(self) -> int:
        return self.parallelism.dp * self.parallelism.tp * self.parallelism.pp

    def to_dict(self) -> dict[str, Any]:
        return {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in asdict(self).items()}


SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_TYPES = {f.name: typing.get_type_hints(Config)[f.name] for f in fields(Config)}


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(options))}"


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Converts a TOML or command-line value to the field's type, or explains why it can't."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if args and type(None) in args:  # Optional[T]
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    from_cli = isinstance(value, str)
    try:
        if origin is list:
            items = [v.strip() for v in value.strip("[]").split(",")] if from_cli else value
            if not isinstance(items, list):
                raise ValueError
            return [_coerce(key, item, args[0]) for item in items]
        if hint is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value) if not from_cli else int(value.replace("_", ""))
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
            return out
        if hint is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        pass
    else:
        raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover - schema bug
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{key}: expected {name}, got {value!r}")


def _set(cfg: Config, dotted: str, value: Any, where: str) -> None:
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}' in {where}{_suggest(section, list(SECTIONS))}")
    if not key:
        raise ConfigError(f"'{dotted}' in {where}: expected section.key, e.g. training.steps")
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if key not in hints:
        raise ConfigError(f"unknown key '{dotted}' in {where}{_suggest(key, list(hints))}")
    setattr(obj, key, _coerce(dotted, value, hints[key]))


def _check_ranges(cfg: Config) -> None:
    for section in fields(cfg):
        obj = getattr(cfg, section.name)
        for f in fields(obj):
            value, meta = getattr(obj, f.name), f.metadata
            key = f"{section.name}.{f.name}"
            if value is None:
                continue
            if meta.get("choices") and value not in meta["choices"]:
                opts = ", ".join(repr(c) for c in meta["choices"])
                raise ConfigError(f"{key}: expected one of {opts}, got {value!r}")
            if meta.get("min") is not None and value < meta["min"]:
                raise ConfigError(f"{key}: expected a value >= {meta['min']}, got {value!r}")


def _resolve_model(model: ModelConfig) -> None:
    preset = {**PRESET_COMMON, **PRESETS[model.size]}
    for key, value in preset.items():
        if getattr(model, key) is None:
            setattr(model, key, value)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field checks; run before any process group exists so errors are printed once."""
    m, p, t, o = cfg.model, cfg.parallelism, cfg.training, cfg.optimizer
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    if m.head_dim % 2:
        raise ConfigError(f"model.hidden_size / model.num_heads = {m.head_dim} must be even for RoPE")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}; "
            "pick num_kv_heads among its divisors"
        )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas: expected two numbers in [0, 1), got {o.betas}")
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}")
    if not 0.0 <= cfg.data.validation_split < 1.0:
        raise ConfigError(f"data.validation_split: expected a fraction in [0, 1), got {cfg.data.validation_split}")
    if m.num_kv_heads % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} must divide model.num_kv_heads={m.num_kv_heads} "
            "(each tp rank holds whole key/value heads)"
        )
    if m.vocab_size % p.tp:
        raise ConfigError(f"parallelism.tp={p.tp} must divide model.vocab_size={m.vocab_size} (vocab-parallel head)")
    if p.tp_mode == "reduce_scatter" and t.seq_len % p.tp:
        raise ConfigError(
            f"training.seq_len={t.seq_len} must be divisible by parallelism.tp={p.tp} "
            "with tp_mode='reduce_scatter' (sequence parallel); or use tp_mode='all_reduce'"
        )
    stages = p.pp * (p.pp_stages_per_rank if p.pp_engine in ("interleaved_1f1b", "zero_bubble", "zbv") else 1)
    if p.pp_engine == "zbv" and p.pp_stages_per_rank != 2:
        raise ConfigError("parallelism.pp_engine='zbv' needs parallelism.pp_stages_per_rank=2 (a V of two stages)")
    if p.pp > 1 and m.num_layers < stages:
        raise ConfigError(
            f"model.num_layers={m.num_layers} is too few for {stages} pipeline stages "
            f"(parallelism.pp={p.pp}"
            + (f" x pp_stages_per_rank={p.pp_stages_per_rank}" if stages > p.pp else "")
            + "); every stage needs at least one layer: lower pp or add layers"
        )
    if p.pp > 1 and m.tie_word_embeddings:
        raise ConfigError(
            "model.tie_word_embeddings=true needs parallelism.pp=1 "
            "(embedding and lm_head live on different pipeline stages)"
        )
    if world_size is not None and world_size != cfg.world_size:
        raise ConfigError(
            f"parallelism dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {cfg.world_size} but {world_size} "
            f"processes were launched; set dp, tp, pp so their product is {world_size}"
        )
    _resolve_batch(cfg)
    # 1F1B-style schedules keep pp microbatches in flight; afab (GPipe) and the zbv V-schedule need no minimum.
    if p.pp > 1 and t.grad_accum_steps < p.pp and p.pp_engine in ("1f1b", "interleaved_1f1b", "zero_bubble"):
        raise ConfigError(
            f"parallelism.pp_engine='{p.pp_engine}' with pp={p.pp} needs at least {p.pp} microbatches "
            f"per step, got grad_accum_steps={t.grad_accum_steps}; raise grad_accum_steps "
            "(or global_batch_size)"
        )


def _resolve_batch(cfg: Config) -> None:
    t, dp = cfg.training, cfg.parallelism.dp
    per_accum = t.micro_batch_size * dp
    if t.global_batch_size == 0:
        if t.grad_accum_steps == 0:
            raise ConfigError("training.grad_accum_steps=0 needs training.global_batch_size > 0 to derive it from")
        t.global_batch_size = per_accum * t.grad_accum_steps
    elif t.global_batch_size % per_accum:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size*dp = {t.micro_batch_size}*{dp} = {per_accum}; "
            "change one of them"
        )
    elif t.grad_accum_steps == 0:
        t.grad_accum_steps = t.global_batch_size // per_accum
    elif t.grad_accum_steps * per_accum != t.global_batch_size:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} disagrees with micro_batch_size*"
            f"grad_accum_steps*dp = {per_accum * t.grad_accum_steps}; set grad_accum_steps=0 "
            "to derive it, or global_batch_size=0"
        )


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Splits `--config F --a.b=1 --c.d 2` into the config path and (key, value) pairs."""
    config_path, pairs, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': expected --section.key=value or --config FILE")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and name != "config"):
                raise ConfigError(f"--{name}: missing value; use --{name}=VALUE")
            value, i = argv[i + 1], i + 1
        if name == "config":
            config_path = value
        else:
            pairs.append((name, value))
        i += 1
    return config_path, pairs


def load_config(
    path: str | None = None,
    overrides: list[tuple[str, str]] = (),
    world_size: int | None = None,
) -> Config:
    """TOML file, then overrides, then presets and validation: the resolved config of a run."""
    cfg = Config()
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config: file '{path}' not found; see configs/ for examples")
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config: '{path}' is not valid TOML ({e})") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"'{section}' in {path}: expected a [section] table{_suggest(section, list(SECTIONS))}"
                )
            for key, value in table.items():
                _set(cfg, f"{section}.{key}", value, path)
    for key, value in overrides:
        _set(cfg, key, value, "command line")
    _check_ranges(cfg)
    _resolve_model(cfg.model)
    _check_ranges(cfg)
    validate(cfg, world_size)
    return cfg


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML: loading it again reproduces the run."""
    lines = []
    for section, table in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    """Every key with its default and meaning, for `--help` and the README's config reference."""
    out = []
    for section in fields(Config):
        out.append(f"[{section.name}]")
        for f in fields(_SECTION_TYPES[section.name]):
            default = f.default if f.default is not MISSING else f.default_factory()
            choices = f" ({'|'.join(map(str, f.metadata['choices']))})" if f.metadata.get("choices") else ""
            out.append(f"  {f.name} = {default!r}{choices}: {f.metadata['help']}")
    return "\n".join(out)
