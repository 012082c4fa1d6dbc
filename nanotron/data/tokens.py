"""A tokenized dir (`nanotron tokenize`), opened for training: each split is one virtual token sequence over its
shards, memory-mapped lazily and never concatenated, so host memory is O(shards), not O(tokens).
"""

from __future__ import annotations

import bisect
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanotron.errors import DataError
from nanotron.tokenize.format import RETOKENIZE, read_meta, shard_name
from nanotron.tokenize.tokenizer import Tokenizer
from nanotron.tokenize.writer import check_all

OPEN_SHARDS = 64  # memory maps kept open per split (each holds a file descriptor); reopening one is an open and an mmap


class TokenStream:
    """One split's shards as a single token sequence: read(start, n) may span shard boundaries."""

    def __init__(self, directory: Path, split: str, shards: list[dict], dtype: np.dtype, what: str) -> None:
        self.dtype, self.what = dtype, what
        self.files, self.offsets = [], [0]
        for index, shard in enumerate(shards):
            if shard["tokens"][split]:
                self.files.append(directory / shard_name(split, index, "bin"))
                self.offsets.append(self.offsets[-1] + shard["tokens"][split])
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def num_samples(self, seq_len: int) -> int:
        """Samples of seq_len + 1 tokens (inputs and shifted targets) starting every seq_len tokens."""
        return max(0, (self.total - 1) // seq_len)

    def read(self, start: int, length: int, vocab_size: int | None = None, sample: str = "") -> np.ndarray:
        """Tokens [start, start + length) of the split, as int64. With `vocab_size`, an id at or beyond it (bit
        rot that kept the file's size, a shard of another tokenizer) is a DataError naming the file, `sample`
        and the id: the file is untrusted input, and the embedding would fail on it with an IndexError. The check
        is one max() over tokens this read already copies (~1% of a sample's read)."""
        out, shard = [], bisect.bisect_right(self.offsets, start) - 1
        while length > 0:
            tokens = self._map(shard)
            begin = start - self.offsets[shard]
            piece = tokens[begin : begin + length]
            if vocab_size is not None and len(piece) and int(piece.max()) >= vocab_size:
                at = begin + int(np.argmax(piece >= vocab_size))
                raise DataError(
                    f"{self.what}: token file '{self.files[shard]}' holds id {int(tokens[at])} at token {at}"
                    f"{f' ({sample})' if sample else ''}, beyond the tokenizer's vocabulary of {vocab_size}: the "
                    f"file is damaged or was written with another tokenizer; {RETOKENIZE}"
                )
            out.append(piece)
            start, length, shard = start + len(piece), length - len(piece), shard + 1
        return np.concatenate(out).astype(np.int64) if len(out) > 1 else out[0].astype(np.int64)

    def _map(self, shard: int) -> np.ndarray:
        """The shard's memory map, checked against meta.json as it opens (ranks that did not check every shard at
        start-up check each one here, at no extra cost)."""
        if shard in self._maps:
            self._maps.move_to_end(shard)
            return self._maps[shard]
        path, expected = self.files[shard], self.offsets[shard + 1] - self.offsets[shard]
        try:
            tokens = np.memmap(path, dtype=self.dtype, mode="r")
        except (OSError, ValueError):
            raise DataError(f"{self.what}: token file '{path}' is missing or unreadable; {RETOKENIZE}") from None
        if len(tokens) != expected:
            raise DataError(
                f"{self.what}: token file '{path}' holds {len(tokens)} tokens but meta.json says {expected} "
                f"(cut short or replaced); {RETOKENIZE}"
            )
        # Samples are read at random: without this, every page fault reads around it up to the device's
        # read_ahead_kb (up to megabytes, for a sample of kilobytes).
        madvise = getattr(getattr(tokens, "_mmap", None), "madvise", None)
        if madvise is not None and hasattr(mmap, "MADV_RANDOM"):
            madvise(mmap.MADV_RANDOM)
        self._maps[shard] = tokens
        if len(self._maps) > OPEN_SHARDS:
            self._maps.popitem(last=False)
        return tokens

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers open their own maps
        return {**self.__dict__, "_maps": OrderedDict()}


@dataclass
class TokenizedData:
    """One dataset of a run: its tokenized dir, its train and validation streams, and how errors name it."""

    path: Path
    meta: dict[str, Any]
    train: TokenStream
    val: TokenStream
    what: str  # the config key naming it: data.path or data.datasets[i].path


def open_tokenized(path: Path, what: str, tokenizer: Tokenizer, check: bool) -> TokenizedData:
    """Opens a finished tokenized dir made with this tokenizer; `check` stats every shard against meta.json."""
    meta = read_meta(path, what)
    if meta["tokenizer"]["fingerprint"] != tokenizer.fingerprint:
        raise DataError(
            f"{what}: '{path}' was tokenized with another tokenizer ({meta['tokenizer']['path']}) than "
            f"data.tokenizer='{tokenizer.path}'; train with that tokenizer, or re-run `nanotron tokenize` with this one"
        )
    if check:
        check_all(path, meta, what)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    streams = [TokenStream(path, split, meta["shards"], dtype, what) for split in ("train", "val")]
    return TokenizedData(path, meta, *streams, what)
