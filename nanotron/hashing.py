"""Stable integer hashing: the same values on every machine, process and Python version (unlike `hash()`)."""

from __future__ import annotations

import hashlib

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer: a 64-bit integer hash in which every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stable_hash64(text: str) -> int:
    """A 64-bit integer from text: the first 8 bytes of its sha256, little-endian. Seeds weight init per parameter
    name and keys the data order, so a change here changes every run's weights and samples."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
