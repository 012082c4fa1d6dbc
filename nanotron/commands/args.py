"""What the commands' argument parsers share: bad flags as one `error:` line, and common help texts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from nanotron.errors import ConfigError

UNVERIFIED_HELP = "read a checkpoint that has no checksums.json (its files are then not checked for corruption)"


class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError, so a bad flag is one `error:` line (exit 2), not usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


class Once(argparse.Action):
    """A flag's second value is refused, not kept in place of the first without a word (argparse's way)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest) is not None:
            first = str(getattr(namespace, self.dest))
            raise ConfigError(f"{option_string} given twice ({first!r}, then {str(values)!r}): give it once")
        setattr(namespace, self.dest, values)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type whose error names the bound: "argument --nodes: expected an integer >= 1, got '0'"."""

    def parse(text: str) -> int:
        value = int(text) if text.lstrip("-").isdigit() else minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def number_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type for a finite float: "argument --tolerance: expected a finite number >= 0, got 'nan'"."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"expected a finite number >= {minimum:g}, got {text!r}")
        return value

    return parse
