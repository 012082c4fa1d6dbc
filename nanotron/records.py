"""Schemas of the small JSON records a run reads back, and the one function that reads and checks them.

A checkpoint's trainer_state.json, the run dir's skipped_samples.json and wandb.json are checked whole, for type and
range, before any of their values is used: a wrong one is one line naming the file and the field, never a traceback
deep in the code that uses it, nor a silently wrong state (NaN in the spike detector's statistics would switch the
guard off). Bit rot is the checksums' to catch (`checkpoint.integrity`); this catches values no run writes.

A schema is a dict (a JSON object: its keys, each required unless wrapped in `Optional`; other keys are ignored),
a list of one schema (a JSON array of such values), a tuple (an array of exactly those), or a `Check`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron.errors import UserError

LARGEST = 2**63 - 1  # what a sample index or counter may reach: an int64


def finite(value: Any) -> bool:
    """A number a float holds: an int or float, not NaN nor Infinity nor an integer beyond the float range (whose
    math.isfinite() is an OverflowError)."""
    return type(value) in (int, float) and -sys.float_info.max <= value <= sys.float_info.max


@dataclass(frozen=True)
class Check:
    """A leaf: `accepts(value)`, described as `expected` in the message that refuses a value."""

    expected: str

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class Integer(Check):
    expected: str = "an integer >= 0"
    minimum: int = 0

    def accepts(self, value: Any) -> bool:
        return type(value) is int and self.minimum <= value <= LARGEST


@dataclass(frozen=True)
class Real(Check):
    """A finite float (JSON's NaN and Infinity literals are refused), at least `minimum`."""

    expected: str = "a finite number"
    minimum: float = -math.inf

    def accepts(self, value: Any) -> bool:
        return finite(value) and value >= self.minimum


@dataclass(frozen=True)
class Text(Check):
    pattern: str = ".*"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None


@dataclass(frozen=True)
class Window(Check):
    """A half-open window of sample positions, [start, end)."""

    expected: str = "[start, end] with 0 <= start < end"

    def accepts(self, value: Any) -> bool:
        ints = isinstance(value, list) and len(value) == 2 and all(Integer().accepts(x) for x in value)
        return ints and value[0] < value[1]


@dataclass(frozen=True)
class Optional:
    """A key that may be absent (records written before it existed)."""

    schema: Any


COUNTER, POSITIVE = Integer(), Integer("an integer >= 1", minimum=1)
FORECAST = (Real(), Real(), Real("a finite number >= 0", minimum=0.0))  # a signal's level, trend, error variance
SIGNALS = {"loss": FORECAST, "grad_norm": FORECAST}
RATIO = Real("a finite number >= 0", minimum=0.0)  # a value over its running mean (0: not scored yet)
LAYOUT = {name: Optional(POSITIVE) for name in ("dp", "cp", "ep", "tp", "pp")} | {"zero_stage": Optional(COUNTER)}

TRAINER_STATE = {
    "step": COUNTER,
    "consumed_samples": COUNTER,
    "consumed_tokens": COUNTER,
    "skipped_steps": Optional(COUNTER),
    "stability": Optional(
        {
            "detector": {
                "observed": COUNTER,
                "stats": SIGNALS,
                "max_z": {"loss": Real(), "grad_norm": Real()},
                # absent from checkpoints saved before the ratio rule
                "mean": Optional({"loss": Real(), "grad_norm": Real()}),
                "max_ratio": Optional({"loss": RATIO, "grad_norm": RATIO}),
            },
            "skipped_samples": [Window()],
            "rollbacks": COUNTER,
            "skips_in_a_row": Optional(COUNTER),  # absent from checkpoints saved before stability.max_skips
        }
    ),
    # recorded for people and tools, never loaded: still checked, so that a value read by a tool is sound
    "global_batch_size": Optional(POSITIVE),
    "world_size": Optional(POSITIVE),
    "layout": Optional(LAYOUT),
}
SKIPPED_WINDOWS = {"windows": [Window()]}
WANDB_STATE = {"id": Text("a W&B run id (letters, digits, - and _)", r"[A-Za-z0-9_-]{1,128}")}


def problem(value: Any, schema: Any, field: str = "") -> str | None:
    """What is wrong with `value` under `schema`, as `field: expected ..., got ...`; None if nothing."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return _refused(field, "a JSON object", value)
        for key, inner in schema.items():
            name = f"{field}.{key}" if field else key
            if key not in value:
                if not isinstance(inner, Optional):
                    return f"{name}: missing"
                continue
            if found := problem(value[key], inner.schema if isinstance(inner, Optional) else inner, name):
                return found
        return None
    if isinstance(schema, (list, tuple)):
        if not isinstance(value, list) or (isinstance(schema, tuple) and len(value) != len(schema)):
            return _refused(field, f"a list of {len(schema)}" if isinstance(schema, tuple) else "a list", value)
        inners = schema if isinstance(schema, tuple) else [schema[0]] * len(value)
        return next((p for i, (v, s) in enumerate(zip(value, inners)) if (p := problem(v, s, f"{field}[{i}]"))), None)
    return None if schema.accepts(value) else _refused(field, schema.expected, value)


def _refused(field: str, expected: str, value: Any) -> str:
    got = repr(value)
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{field + ': ' if field else ''}expected {expected}, got {got}"


def read(path: Path, schema: Any, error: type[UserError], hint: str = "") -> Any:
    """The JSON record in `path`, checked against `schema`; else `error` naming the file and the field, then `hint`
    (what to do about it)."""
    tail = f"; {hint}" if hint else ""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as failure:
        raise error(f"'{path}' is unreadable ({type(failure).__name__}: {failure}){tail}") from None
    except (ValueError, RecursionError) as failure:
        raise error(f"'{path}' is not valid JSON ({failure}){tail}") from None
    if found := problem(value, schema):
        raise error(f"'{path}': {found}{tail}")
    return value
