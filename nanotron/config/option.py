"""How a config key is declared: one dataclass field = one key, with its default, help text, choices and
bounds; `--help`, the launcher's flags and validation all read them from the field."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(
    default: Any,
    help: str,
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    below: float | None = None,
) -> Any:
    """A config field: its default, its help line and its bounds (`min` and `max` inclusive, `below` exclusive)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "below": below}
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
