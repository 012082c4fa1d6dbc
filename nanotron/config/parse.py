"""TOML files and `--section.key=value` overrides in, the resolved config as TOML out.

Every key is a schema field; anything else is a `ConfigError` naming the key, what was expected and a fix.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import sys
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

from nanotron.config.model import ModelConfig
from nanotron.config.schema import Config
from nanotron.config.validate import resolve_model, validate
from nanotron.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SECTIONS = {f.name: typing.get_type_hints(Config)[f.name] for f in fields(Config)}
_TOKENIZE = "tokenize before training: `nanotron tokenize SOURCE --tokenizer T --out DIR"
# Removed keys -> what replaces them: one line saying so, instead of "unknown key".
RETIRED = {
    "parallelism.recompute_layer": "use parallelism.recompute='full'",
    "model.mup_base_width": "use [model.mup_base] hidden = <base width>, with heads (or head_dim) and intermediate",
    "model.mup_base_depth": "use [model.mup_base] layers = <base depth>",
    "model.mup_base_head_dim": "use [model.mup_base] head_dim = <base head dim>",
    "data.cache_dir": f"{_TOKENIZE}`, then set data.path=DIR",
    "data.max_auto_tokenize_mb": f"{_TOKENIZE}`, then set data.path=DIR",
    "data.tokenize_workers": f"{_TOKENIZE} --workers N`",
    "data.text_column": f"{_TOKENIZE} --text_column NAME`",
    "data.validation_split": f"{_TOKENIZE} --validation_split FRACTION`",
    "checkpoint.async_save": 'use checkpoint.async_mode = "async" (was true) or "sync" (was false)',
}


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(options))}"


def _coerce(key: str, value: Any, hint: Any, from_cli: bool) -> Any:
    """Converts a TOML value (typed: a quoted "3" is no int) or a command-line one (text, parsed by the field's
    type) to the field's type, or explains why it can't."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if args and type(None) in args:  # Optional[T]
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    quoted = not from_cli and isinstance(value, str) and hint in (bool, int, float)
    try:
        if origin is list:
            items = [v.strip() for v in value.strip("[]").split(",") if v.strip()] if from_cli else value
            if not isinstance(items, list):
                raise ValueError
            return [
                _coerce(f"{key}[{i}]" if is_dataclass(args[0]) else key, v, args[0], from_cli)
                for i, v in enumerate(items)
            ]
        if is_dataclass(hint):
            spelled = from_cli and hasattr(hint, "from_text")  # a [[data.datasets]] entry as `path:weight`
            return _table(key, hint.from_text(value) if spelled else value, hint, from_cli)
        if quoted:
            raise ValueError
        if hint is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            if not from_cli:
                return int(value)
            text = value.replace("_", "")
            with contextlib.suppress(ValueError):
                return int(text)
            exact = float(text)  # 1e3, as a TOML file may write it: integral and exact in a double, else refused
            if not (exact.is_integer() and abs(exact) < 2**53):
                raise ValueError
            return int(exact)
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
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond any float
        pass
    else:
        raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover - schema bug
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(
        f"{key}: expected {name}, got {value!r}" + (" (a quoted TOML string: drop the quotes)" if quoted else "")
    )


def _table(key: str, value: Any, hint: type, from_cli: bool) -> Any:
    """A TOML table (e.g. one [[data.datasets]] entry) as its dataclass, every key checked like a section's."""
    hints = typing.get_type_hints(hint)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table with keys {', '.join(hints)}, got {value!r}")
    table = hint()
    for name, item in value.items():
        if name not in hints:
            raise ConfigError(f"unknown key {name!r} in {key}{_suggest(name, list(hints))}")
        setattr(table, name, _coerce(f"{key}.{name}", item, hints[name], from_cli))
    return table


def _set(cfg: Config, dotted: str, value: Any, where: str, from_cli: bool = False) -> None:
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"unknown section {section!r} in {where}{_suggest(section, list(SECTIONS))}")
    if not key:
        raise ConfigError(f"{dotted!r} in {where}: expected section.key, e.g. training.steps")
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    table, _, sub = key.partition(".")
    if sub and table in hints and is_dataclass(hints[table]):  # --model.moe.num_experts=8: one key of a table
        obj = getattr(obj, table)
        hints = typing.get_type_hints(hints[table])
        key = sub
    if dotted in RETIRED:
        raise ConfigError(f"{dotted} was removed: {RETIRED[dotted]} ({where})")
    if key not in hints:
        raise ConfigError(f"unknown key {dotted!r} in {where}{_suggest(key, list(hints))}")
    if is_dataclass(hints[key]) and isinstance(value, dict):  # a [model.moe] table sets the keys it names
        for name, item in value.items():
            _set(cfg, f"{dotted}.{name}", item, where)
        return
    setattr(obj, key, _coerce(dotted, value, hints[key], from_cli))


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Splits `--config F --a.b=1 --c.d 2` into the config path and (key, value) pairs."""
    config_path = None
    pairs = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            hint = f"; did you mean --config {arg}?" if arg.endswith((".toml", ".yaml", ".yml")) else ""
            raise ConfigError(f"unexpected argument {arg!r}: expected --section.key=value or --config FILE{hint}")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and name != "config"):
                raise ConfigError(f"--{name}: missing value; use --{name}=VALUE")
            value, i = argv[i + 1], i + 1
        if name == "config-file":
            raise ConfigError("--config-file is the original nanotron's spelling: use --config FILE (a TOML file)")
        if name == "config":
            if config_path is not None:  # the last one would win without a word
                raise ConfigError(f"--config given twice ({config_path!r}, then {value!r}): give it once")
            config_path = value
        else:
            pairs.append((name, value))
        i += 1
    return config_path, pairs


def _read_tables(path: Path, what: str) -> dict[str, Any]:
    """The TOML file's top-level tables; a missing or malformed file is a ConfigError naming it."""
    if not path.is_file():
        raise ConfigError(f"{what}: file '{path}' not found; see configs/ for examples")
    if path.suffix.lower() in (".yaml", ".yml"):
        raise ConfigError(
            f"{what}: '{path}' is YAML; nanotron configs are TOML with [section] tables: convert the original "
            f"nanotron's YAML with `nanotron config from-nanotron {path} > new.toml` (see configs/*.toml, and "
            "`python -m nanotron.train --help` for every key)"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what}: '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); TOML files are UTF-8"
        ) from None
    except RecursionError:
        raise ConfigError(f"{what}: '{path}' is not valid TOML (values nested too deeply)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what}: '{path}' is not valid TOML ({e})") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section!r} in {path}: expected a [section] table{_suggest(section, list(SECTIONS))}")
    return data


def _set_file(cfg: Config, tables: dict[str, Any], path: Path, saved: bool) -> None:
    """Every key of a TOML file's tables. A config.toml nanotron `saved` (a run's or a checkpoint's) may hold keys
    retired since, at values that meant nothing then: they are skipped, so older checkpoints stay readable."""
    for section, table in tables.items():
        for key, value in table.items():
            if not (saved and f"{section}.{key}" in RETIRED):
                _set(cfg, f"{section}.{key}", value, str(path))


def load_config(
    path: str | Path | None = None,
    overrides: list[tuple[str, str]] = (),
    world_size: int | None = None,
    saved: bool = False,
) -> Config:
    """TOML file (`saved`: one nanotron wrote, see `_set_file`), then overrides, then presets and validation: the
    resolved config of a run."""
    cfg = Config()
    if path is not None:
        _set_file(cfg, _read_tables(Path(path), "--config"), Path(path), saved)
    for key, value in overrides:
        _set(cfg, key, value, "command line", from_cli=True)
    validate(cfg, world_size)
    return cfg


def read_model_config(path: Path) -> ModelConfig:
    """The resolved [model] section of a TOML file (a checkpoint's or an HF import's config.toml)."""
    table = _read_tables(Path(path), "model config").get("model")
    if not isinstance(table, dict):
        raise ConfigError(f"'{path}' has no [model] section: cannot tell the model's shape")
    cfg = Config()
    _set_file(cfg, {"model": table}, Path(path), saved=True)
    resolve_model(cfg.model)
    return cfg.model


def read_saved_config(tables: dict[str, Any], where: str) -> Config:
    """The config a saved config.toml's `tables` (already parsed) describe, unvalidated: every key it lacks (added
    since the save) at its default, which keeps the behaviour of before the key, and the model's shape resolved."""
    cfg = Config()
    _set_file(cfg, tables, Path(where), saved=True)
    resolve_model(cfg.model)
    return cfg


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        escaped = (_TOML_ESCAPES.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in value)
        return '"' + "".join(escaped) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml_value(v)}" for key, v in value.items()) + "}"
    return repr(value)


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """`[section]` tables of plain values as TOML text (strings escaped, None values left out)."""
    lines = []
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items() if value is not None]
        lines.append("")
    return "\n".join(lines)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML: loading it again reproduces the run, at this layout or another one.

    grad_accum_steps is written as 0 (derive) once global_batch_size is known: the accumulation a layout needs
    follows from the global batch, so the file does not pin this layout's value.
    """
    tables = cfg.to_dict()
    if tables["training"]["global_batch_size"] > 0:
        tables["training"]["grad_accum_steps"] = 0
    return toml_text(tables)


def help_text() -> str:
    """Every key with its default and meaning, for `--help` (docs/configuration.md's key table names them all)."""
    out = []
    for section in fields(Config):
        out.append(f"[{section.name}]")
        for f in fields(SECTIONS[section.name]):
            default = f.default if f.default is not MISSING else f.default_factory()
            if is_dataclass(default):  # a table such as [model.moe]: its keys, spelled as on the command line
                out.append(f"  [{section.name}.{f.name}] {f.metadata['help']}")
                out += [f"  {f.name}.{line}" for line in _field_lines(default)]
                continue
            out += [f"  {line}" for line in _field_lines(default, f)]
    return "\n".join(out)


def _field_lines(value: Any, f: Any = None) -> list[str]:
    """`key = default (choices): help` for one field, or for every field of a table's dataclass."""
    items = [(f, value)] if f is not None else [(g, getattr(value, g.name)) for g in fields(value)]
    lines = []
    for field_, default in items:
        choices = f" ({'|'.join(map(str, field_.metadata['choices']))})" if field_.metadata.get("choices") else ""
        lines.append(f"{field_.name} = {default!r}{choices}: {field_.metadata['help']}")
    return lines
