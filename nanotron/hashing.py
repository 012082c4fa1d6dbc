"""Stable integer hashing: the same values on every machine, process and Python version (unlike `hash()`)."""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer: a 64-bit integer hash in which every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
