"""The global sample order without materialising anything: a keyed bijection per (seed, dataset, epoch), and a
weighted blend of datasets, both computed per sample in O(1) / O(log datasets) time and O(1) memory.

Start-up and resume therefore cost the same at 1e3 and 1e12 samples: where a run continues is only its global
sample count (the trainer's consumed_samples).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from nanotron.hashing import mix64, stable_hash64


def key_of(*parts: Any) -> int:
    """A 64-bit key from any parts, stable across processes and Python versions (unlike hash())."""
    return stable_hash64(repr(parts))


class Permutation:
    """A keyed bijection of [0, n): a 4-round Feistel network on the smallest even-bit power of two >= n, with
    cycle-walking (re-encrypt until the value falls in [0, n)). The domain is < 4n, so a call costs on average
    fewer than 4 encryptions (a few microseconds in Python) and the permutation is never stored."""

    ROUNDS = 4

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError("a permutation needs n >= 1")
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [mix64(key ^ mix64(round_)) for round_ in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"{index} is outside [0, {self.n})")
        x = self._encrypt(index)
        while x >= self.n:
            x = self._encrypt(x)
        return x


class Blend:
    """Which dataset global sample g comes from, and its index among that dataset's samples, for weights w_d.

    A balanced binary tree over the datasets; a node whose left side holds weight L of its total T sends its k-th
    sample left iff c(k+1) > c(k), with c(k) = floor((k·L + T/2) / T) the left samples among its first k (a
    Bresenham line: the left share of every prefix is within half a sample of L/T). Going down the tree therefore
    also yields the sample's index in the chosen dataset, so a lookup is O(log datasets), exact integer
    arithmetic, and each dataset's share of any first n samples is within ceil(log2(datasets)) samples of n·w_d.
    """

    def __init__(self, weights: list[float]) -> None:
        ratios = [Fraction(repr(float(w))) for w in weights]
        if not ratios or min(ratios) <= 0:
            raise ValueError("blend weights must be positive")
        scale = math.lcm(*(r.denominator for r in ratios))
        self.weights = [int(r * scale) for r in ratios]
        self.root = self._node(0, len(self.weights))

    def _node(self, first: int, end: int) -> Any:
        """A leaf is a dataset index; an inner node is (left weight, total weight, left node, right node)."""
        if end - first == 1:
            return first
        middle = (first + end) // 2
        left = sum(self.weights[first:middle])
        return left, sum(self.weights[first:end]), self._node(first, middle), self._node(middle, end)

    def locate(self, g: int) -> tuple[int, int]:
        """(dataset, index within that dataset's samples) of global sample g."""
        node, k = self.root, g
        while not isinstance(node, int):
            left, total, left_node, right_node = node
            before = (k * left + total // 2) // total
            if ((k + 1) * left + total // 2) // total > before:
                node, k = left_node, before
            else:
                node, k = right_node, k - before
        return node, k

    def counts(self, n: int) -> list[int]:
        """How many of the first n global samples each dataset provides."""
        out = [0] * len(self.weights)

        def split(node: Any, k: int) -> None:
            if isinstance(node, int):
                out[node] = k
                return
            left, total, left_node, right_node = node
            before = (k * left + total // 2) // total
            split(left_node, before)
            split(right_node, k - before)

        split(self.root, n)
        return out
