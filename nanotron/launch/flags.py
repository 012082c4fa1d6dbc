"""The launcher's flags → a config file to start from and the overrides on top of it.

Without `--config`, a run starts from `configs/<model_size>.toml`, so a launched `base` model trains exactly as
`configs/base.toml` says (dtype, sequence length, batch, ZeRO stage, schedule); the flags given override it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from pathlib import Path

from nanotron.config import PRESETS, Config, load_config
from nanotron.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Launcher flag -> config keys it sets; help and choices come from the config schema, values are checked there.
CONFIG_FLAGS: dict[str, tuple[str, ...]] = {
    "model_size": ("model.size",),
    "hidden_size": ("model.hidden_size",),
    "intermediate_size": ("model.intermediate_size",),
    "num_layers": ("model.num_layers",),
    "num_heads": ("model.num_heads",),
    "num_kv_heads": ("model.num_kv_heads",),
    "vocab_size": ("model.vocab_size",),
    "max_seq_len": ("model.max_seq_len", "training.seq_len"),
    "seq_len": ("training.seq_len",),
    "train_steps": ("training.steps",),
    "micro_batch_size": ("training.micro_batch_size",),
    "grad_accum_steps": ("training.grad_accum_steps", "training.global_batch_size=0"),
    "learning_rate": ("optimizer.lr",),
    "warmup_steps": ("optimizer.warmup_steps",),
    "dataset": ("data.path",),
    "dp": ("parallelism.dp",),
    "tp": ("parallelism.tp",),
    "cp": ("parallelism.cp",),
    "ep": ("parallelism.ep",),
    "pp": ("parallelism.pp",),
    "pp_engine": ("parallelism.pp_engine",),
    "tp_mode": ("parallelism.tp_mode",),
    "save_interval": ("checkpoint.interval",),
    "save_initial_state": ("checkpoint.save_initial_state",),
    "resume_from_checkpoint": ("checkpoint.resume_from",),
    "profiler_export_path": ("profiler.export_path",),
    "preflight": ("training.preflight",),
}

# The original nanotron launcher's (slurm_launcher.py) hyphenated flags that are this launcher's flags spelled with
# underscores: they keep working.
ORIGINAL_HYPHENATED = {
    "hidden-size",
    "intermediate-size",
    "num-layers",
    "num-heads",
    "num-kv-heads",
    "vocab-size",
    "learning-rate",
    "warmup-steps",
    "save-interval",
    "save-initial-state",
    "dry-run",
    "show-logs",
}
# The original launcher's flags that are named differently here: a hint instead of "unrecognized".
ORIGINAL_FLAGS = {
    "run": "--run_name",
    "model": "--model_size (tiny, small, base, large) or --hidden_size/--num_layers/--num_heads",
    "seq": "--seq_len (and --max_seq_len for the model's longest sequence)",
    "mbs": "--micro_batch_size",
    "acc": "--grad_accum_steps",
    "steps": "--train_steps",
    "min-lr": "--optimizer.min_lr=VALUE",
    "weight-decay": "--optimizer.weight_decay=VALUE",
    "grad-clip": "--training.clip_grad=VALUE",
    "zero": "--parallelism.zero_stage=VALUE",
    "seed": "--job.seed=VALUE",
    "tokenizer": "--data.tokenizer=PATH",
    "text-column": "`nanotron tokenize --text_column NAME` (the run trains from its output dir, --dataset)",
    "checkpoints-path": "--checkpoint.dir=PATH",
}


def flag_help(flag: str) -> str:
    """The config key's own help and choices: flags and config can't drift apart."""
    key = CONFIG_FLAGS[flag][0]
    section, name = key.split(".")
    meta = next(f.metadata for f in fields(getattr(Config(), section)) if f.name == name)
    choices = f"; one of {', '.join(map(str, meta['choices']))}" if meta.get("choices") else ""
    return f"{meta['help']} [{', '.join(CONFIG_FLAGS[flag])}{choices}]"


def original_spellings(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The original launcher's hyphenated flags (`--dry-run`) as this launcher's; its flags called differently
    here, and other hyphenated forms of this launcher's flags, are one line naming the flag to use."""
    flags = {o for action in parser._actions for o in action.option_strings}
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if not name.startswith("--") or name in flags or "." in name:
            out.append(arg)
            continue
        spelled = "--" + name[2:].replace("-", "_")
        if name[2:] in ORIGINAL_HYPHENATED:
            out.append(spelled + eq + value)
        elif name[2:] in ORIGINAL_FLAGS:
            raise ConfigError(f"unrecognized argument {name}: nanotron's original {name} is {ORIGINAL_FLAGS[name[2:]]}")
        elif spelled in flags:
            raise ConfigError(f"unrecognized argument {name}: use {spelled}")
        else:
            out.append(arg)
    return out


def llama_intermediate_size(hidden_size: int) -> int:
    """Llama's SwiGLU width: 8/3 of the hidden size, rounded up to a multiple of 256 (4096 → 11008)."""
    return 256 * math.ceil(int(8 * hidden_size / 3) / 256)


def _positive(value: str | None) -> int | None:
    """A flag's value as a positive integer, or None (the config's own check then reports a bad value)."""
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def starting_config(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The TOML file a run starts from, and a note on how it was chosen when the user did not say."""
    if args.config is not None:
        return Path(args.config), []
    size, notes, hidden = args.model_size, [], _positive(args.hidden_size)
    if size is None and hidden is not None:  # a custom architecture: the training defaults of its scale
        size = min(PRESETS, key=lambda s: abs(math.log(hidden / PRESETS[s]["hidden_size"])))
        notes.append(
            f"note: starting from configs/{size}.toml, the preset nearest --hidden_size {hidden} (its "
            "vocabulary, sequence length and training settings); pass --model_size or --config to choose"
        )
    return CONFIGS / f"{size if size in PRESETS else 'tiny'}.toml", notes


def config_overrides(args: argparse.Namespace, passthrough: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (key, value) overrides of the flags the user gave, then the --section.key=value ones."""
    pairs = []
    for flag in CONFIG_FLAGS:
        value = getattr(args, flag)
        if value is None:
            continue
        for key in CONFIG_FLAGS[flag]:
            key, fixed, fixed_value = key.partition("=")  # "key=value": a value the flag implies
            pairs.append((key, fixed_value if fixed else str(value)))
    if args.learning_rate is not None:  # as the seed launcher: decay to a tenth of the peak, never above it
        pairs.append(("optimizer.min_lr", str(float(args.learning_rate) / 10)))
    given = {key for key, _ in [*pairs, *passthrough]}
    if _positive(args.hidden_size) is not None and "model.intermediate_size" not in given:
        pairs.append(("model.intermediate_size", str(llama_intermediate_size(int(args.hidden_size)))))
    return [*pairs, *passthrough, ("job.name", args.run_name)]


def fit_max_seq_len(path: Path, args: argparse.Namespace, overrides: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """--seq_len longer than the model's max_seq_len raises max_seq_len too (it only sizes the RoPE table)."""
    seq_len = _positive(args.seq_len)
    if seq_len is None or any(key == "model.max_seq_len" for key, _ in overrides):
        return overrides
    model = load_config(path, [(key, value) for key, value in overrides if key != "training.seq_len"]).model
    return overrides if model.max_seq_len >= seq_len else [*overrides, ("model.max_seq_len", str(seq_len))]


def model_summary(cfg: Config) -> str:
    """The model a run trains, in one line: what --model_size, the file and the flags resolved to."""
    from nanotron.models.shapes import num_params

    m, count = cfg.model, num_params(cfg.model)
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    return (
        f"model: {size} parameters | {m.num_layers} layers | hidden {m.hidden_size} | intermediate "
        f"{m.intermediate_size} | {m.num_heads} heads ({m.num_kv_heads} kv) | vocab {m.vocab_size} | "
        f"seq_len {cfg.training.seq_len} (max {m.max_seq_len}) | {cfg.training.dtype}"
    )
