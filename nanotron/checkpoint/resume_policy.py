"""What a resume may change: every key that differs from the checkpoint's config is listed, and the changes
the checkpoint cannot honour are refused in one line before anything is built.

Honoured: the schedule (a function of the step and the current [optimizer]/[training] keys), AdamW's betas,
eps and weight decay (re-applied after the load), the layout (DCP reshards), data and logging keys.
Refused: optimizer.name unless checkpoint.reset_optimizer (then the optimizer state starts afresh), the model's
shape and math, the tokenizer (token ids would change meaning) and seq_len; the global
batch too unless checkpoint.allow_global_batch_size_change is set (the data position then shifts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanotron.config import Config, to_toml
from nanotron.config.parse import RETIRED, read_saved_config, tomllib
from nanotron.errors import CheckpointError, ConfigError
from nanotron.tokenize.tokenizer import load_tokenizer

# model.attention: document masking changes which tokens attend to which, not the weights' meaning
MODEL_KEYS_A_RESUME_MAY_CHANGE = {"model.size", "model.init_std", "model.max_seq_len", "model.attention"}
LAYOUT_SECTIONS = ("parallelism.",)
LAYOUT_KEYS = {"training.micro_batch_size", "training.grad_accum_steps"}


def _flat(tables: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model.moe.top_k": 2, ...}: a table within a section ([model.moe]) by its own keys, so that a change
    names the keys that changed, not the whole table twice."""
    flat = {}
    for key, value in tables.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(
    saved_toml: str, cfg: Config, where: str = "the checkpoint's config.toml"
) -> dict[str, tuple[Any, Any]]:
    """{key: (checkpoint's value, current value)} for every key that differs (both read as TOML); keys retired
    since the save are none of them (see `nanotron.config.parse.RETIRED`), and a key added since counts at what the
    saved config loads as (its default), so upgrading nanotron between a save and its resume changes nothing."""
    tables = tomllib.loads(saved_toml)
    old, new = _flat(tables), _flat(tomllib.loads(to_toml(cfg)))
    added = new.keys() - old.keys()
    if added:
        loaded = _flat(tomllib.loads(to_toml(read_saved_config(tables, where))))
        old |= {key: loaded[key] for key in added if key in loaded}
    keys = sorted((old.keys() - RETIRED.keys()) | new.keys())
    return {key: (old.get(key), new.get(key)) for key in keys if old.get(key) != new.get(key)}


def refused(key: str, allow_batch_change: bool, reset_optimizer: bool = False) -> bool:
    if key == "optimizer.name":  # AdamW's moments are no Muon momentum: a fresh optimizer state, when asked
        return not reset_optimizer
    if key.startswith("model."):
        return key not in MODEL_KEYS_A_RESUME_MAY_CHANGE
    if key == "training.global_batch_size":
        return not allow_batch_change
    return key == "training.seq_len"


def check_resume(cfg: Config, step_dir: Path) -> str | None:
    """Refuses what the checkpoint in `step_dir` cannot honour; returns the line listing what changed."""
    file = step_dir / "config.toml"
    if not file.is_file():
        return f"resume: {step_dir} has no config.toml, so changed keys can't be listed"
    try:
        changes = config_changes(file.read_text(encoding="utf-8"), cfg, str(file))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise CheckpointError(f"'{file}' is unreadable ({type(error).__name__}: {error})") from None
    allow = cfg.checkpoint.allow_global_batch_size_change
    bad = [key for key in changes if refused(key, allow, cfg.checkpoint.reset_optimizer)]
    saved_tokenizer = step_dir / "tokenizer"
    if (saved_tokenizer / "tokenizer.json").is_file():
        saved = load_tokenizer(saved_tokenizer, what=f"the tokenizer saved in {step_dir}")
        if saved.fingerprint != load_tokenizer(cfg.data.tokenizer).fingerprint:
            bad.append("data.tokenizer (another vocabulary)")
    if bad:
        listed = "; ".join(_change(key, changes) if key in changes else key for key in bad)
        hint = " (or set checkpoint.allow_global_batch_size_change=true)" if "training.global_batch_size" in bad else ""
        if "optimizer.name" in bad:
            hint += " (or set checkpoint.reset_optimizer=true to start the optimizer state afresh)"
        raise ConfigError(
            f"resume from {step_dir}: cannot honour {listed}; restore the checkpoint's values{hint}, or start a "
            "new run (another job.name, or checkpoint.init_from for its weights)"
        )
    if not changes:
        return None
    tagged = [_change(key, changes) + (" (resharded)" if _is_layout(key) else "") for key in changes]
    return f"resume: config differs from {file}: " + "; ".join(tagged)


def _is_layout(key: str) -> bool:
    return key.startswith(LAYOUT_SECTIONS) or key in LAYOUT_KEYS


def _change(key: str, changes: dict[str, tuple[Any, Any]]) -> str:
    old, new = changes[key]
    return f"{key} {old!r} -> {new!r}"
