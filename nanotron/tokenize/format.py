"""The on-disk layout of a tokenized dir, shared by its writer (`nanotron tokenize`) and the trainer's reader.

    DIR/meta.json            what the dir holds (written last: its presence means finished)
    DIR/train-00000.bin      shard 0's train tokens: flat little-endian uint16 (vocab <= 65536) or uint32
    DIR/train-00000.idx      shard 0's document index: uint64 end offset, in tokens, of each document in the .bin
    DIR/val-00000.bin, .idx  the same for the validation documents of shard 0
    DIR/progress.json        while unfinished: the committed shards, so a re-run resumes after the last one

Every document is followed by EOS and lies whole in one shard. meta.json records the tokenizer's fingerprint,
EOS id, dtype, the documents and tokens per split, the sources, and every file with its size and sha256.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nanotron.errors import DataError

FORMAT = "nanotron-tokens"
VERSION = 1
SPLITS = ("train", "val")
META = "meta.json"
PROGRESS = "progress.json"
LOCK = ".lock"
RETOKENIZE = "re-run `nanotron tokenize` to rebuild it"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned type that holds every id (ids are < vocab_size)."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


TOKEN_DTYPES = tuple(token_dtype(vocab).name for vocab in (1, 1 << 17))  # all `nanotron tokenize` writes


def shard_name(split: str, index: int, kind: str) -> str:
    """`train-00003.bin`: shards sort by name in document order."""
    return f"{split}-{index:05d}.{kind}"


def is_tokenized(path: Path) -> bool:
    """Whether `path` is a tokenized dir (finished or not); a raw corpus folder never holds these files."""
    return path.is_dir() and ((path / META).is_file() or (path / PROGRESS).is_file())


def read_meta(directory: Path, what: str) -> dict[str, Any]:
    """A finished tokenized dir's meta.json, or one line saying why it can't be used."""
    meta_path = directory / META
    if not meta_path.is_file():
        raise DataError(
            f"{what}: '{directory}' is an unfinished `nanotron tokenize` output (no {META} yet); re-run the same "
            "`nanotron tokenize` command to finish it (it resumes at the first unfinished shard)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{what}: '{meta_path}' is unreadable ({e}); {RETOKENIZE}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(
            f"{what}: '{meta_path}' is not a {FORMAT} v{VERSION} meta.json (another tool or version wrote it); "
            f"{RETOKENIZE}"
        )
    _check_fields(meta, f"{what}: '{meta_path}'")
    return meta


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_counts(value: Any) -> bool:
    """A count per split, e.g. {"train": 3, "val": 1}."""
    return isinstance(value, dict) and all(_is_count(value.get(split)) for split in SPLITS)


def _is_shard(shard: Any) -> bool:
    """A shard record as readers use it: token counts per split and the files with their byte sizes and sha256."""
    if not isinstance(shard, dict) or not _is_counts(shard.get("tokens")):
        return False
    files = shard.get("files")
    return isinstance(files, dict) and all(
        isinstance(f, dict) and _is_count(f.get("bytes")) and isinstance(f.get("sha256"), str) for f in files.values()
    )


def _check_fields(meta: dict[str, Any], where: str) -> None:
    """Every field a reader uses has the type it expects: one line naming the first that does not (meta.json is
    input like any other: a hand edit or another tool's file must not become a TypeError deep in a reader)."""
    tokenizer = meta.get("tokenizer")
    checks = [
        ("dtype", meta.get("dtype") in TOKEN_DTYPES, " or ".join(map(repr, TOKEN_DTYPES))),
        (
            "shards",
            isinstance(meta.get("shards"), list) and all(_is_shard(s) for s in meta["shards"]),
            "a list of shard records",
        ),
        (
            "tokenizer",
            isinstance(tokenizer, dict) and all(isinstance(tokenizer.get(k), str) for k in ("fingerprint", "path")),
            "a table with 'fingerprint' and 'path'",
        ),
        ("eos_id", _is_count(meta.get("eos_id")), "an integer >= 0"),
        ("vocab_size", _is_count(meta.get("vocab_size")), "an integer >= 0"),
        ("documents", _is_counts(meta.get("documents")), "an integer >= 0 per split ('train', 'val')"),
        ("tokens", _is_counts(meta.get("tokens")), "an integer >= 0 per split ('train', 'val')"),
    ]
    for field, ok, expected in checks:
        if not ok:
            shown = repr(meta.get(field))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise DataError(f"{where}: field '{field}' is {shown}, expected {expected}; {RETOKENIZE}")


def check_files(directory: Path, files: dict[str, dict[str, Any]], itemsize: int, what: str) -> None:
    """Every listed file exists with its recorded size: one stat each, nothing read.

    Sizes catch what really happens to token files (a copy cut short, a shard missing, a file from another
    run); hashing them is left to `nanotron tokenize`, which records a sha256 per file: at TB scale reading
    every shard at each start-up would cost more than the training step it protects.
    """
    for name, record in files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except (OSError, ValueError):  # ValueError: a name with a NUL byte or a lone surrogate
            raise DataError(f"{what}: token file '{path}' listed in {META} is missing; {RETOKENIZE}") from None
        if size != record["bytes"]:
            odd = f", not a whole number of {itemsize}-byte tokens" if name.endswith(".bin") and size % itemsize else ""
            raise DataError(
                f"{what}: token file '{path}' is {size} bytes but {META} says {record['bytes']} (cut short or "
                f"replaced{odd}); {RETOKENIZE}"
            )


def summary(meta: dict) -> str:
    """One line: documents, tokens per split, dtype and shards of a tokenized dir."""
    docs, tokens = meta["documents"], meta["tokens"]
    return (
        f"{docs['train']} train / {docs['val']} validation documents, {tokens['train']} / {tokens['val']} tokens "
        f"({meta['dtype']}, {len(meta['shards'])} shards)"
    )
