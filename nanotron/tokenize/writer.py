"""Sources → a tokenized dir (see `format.py`), shard by shard, resumable, identical for any number of workers.

The bytes written depend on the data only: documents are encoded in order (see `encode.py`), each goes to the
train or validation split by a keyed function of its global index, and a shard closes at the first document
boundary past `shard_tokens`. Each shard is committed by rename and then recorded in progress.json, so a run
killed at any moment resumes after its last committed shard; meta.json, written last, marks the dir finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from nanotron import records
from nanotron.console import format_count, say
from nanotron.errors import DataError
from nanotron.hashing import mix64
from nanotron.io import check_not_input, fsync_dir, write_atomic
from nanotron.tokenize.encode import batches, encode_batches
from nanotron.tokenize.format import (
    FORMAT,
    LOCK,
    META,
    PROGRESS,
    SPLITS,
    VERSION,
    check_files,
    read_meta,
    shard_name,
    token_dtype,
)
from nanotron.tokenize.sources import Source, iter_documents, resolve_sources, sources_key
from nanotron.tokenize.tokenizer import Tokenizer, load_tokenizer

DEFAULT_VALIDATION_SPLIT = 0.05  # of documents held out
DEFAULT_SHARD_TOKENS = 1 << 29  # ~1 GiB of uint16 per shard: few files at TB scale, cheap to redo after a kill
PROGRESS_SECONDS = 30.0  # between progress lines when the output is not a terminal
_OUR_FILES = re.compile(r"(train|val)-\d{5}\.(bin|idx)|meta\.json|progress\.json|\.lock")
# What a killed run leaves behind: the open shard's files, and write_atomic's temporaries of them and of the JSON.
_TEMPORARY = re.compile(r"\.{1,2}(train|val)-\d{5}\.(bin|idx)\.partial(\.tmp\d+)?|\.(meta|progress)\.json\.tmp\d+")


class ValidationSplit:
    """Whether document i is held out, in O(1) from i alone: documents fall into consecutive strata of ~1/f
    (f = the fraction, as an exact ratio p/q: stratum s = floor(i·p/q)), and a keyed hash of s picks one document
    of each stratum. The validation set is then exactly f of the documents (±1), spread evenly, never a block."""

    def __init__(self, fraction: float, seed: int) -> None:
        ratio = Fraction(fraction).limit_denominator(1_000_000)
        self.p, self.q, self.key = ratio.numerator, ratio.denominator, mix64(seed)

    def __call__(self, index: int) -> bool:
        if self.p == 0:
            return False
        stratum = index * self.p // self.q
        first, end = -(-stratum * self.q // self.p), -(-(stratum + 1) * self.q // self.p)
        return index == first + mix64(self.key ^ stratum) % (end - first)


class ShardWriter:
    """Appends documents to the open shard's train and validation files and commits the shard (fsync, rename,
    progress.json) at the first document boundary past `shard_tokens`."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, shards: list[dict], on_commit) -> None:
        self.out, self.dtype, self.shard_tokens, self.shards, self.on_commit = (
            out,
            dtype,
            shard_tokens,
            shards,
            on_commit,
        )
        self.next_document = shards[-1]["first_document"] + shards[-1]["documents"] if shards else 0
        self.files: dict[str, Any] = {}

    def _partial(self, split: str, kind: str) -> Path:
        return self.out / f".{shard_name(split, len(self.shards), kind)}.partial"

    def _open(self) -> None:
        self.first_document = self.next_document
        self.files = {split: open(self._partial(split, "bin"), "wb") for split in SPLITS}
        self.hashes = {split: hashlib.sha256() for split in SPLITS}
        self.ends: dict[str, list[int]] = {split: [] for split in SPLITS}
        self.tokens = dict.fromkeys(SPLITS, 0)

    def add(self, tokens: np.ndarray, split: str) -> None:
        if not self.files:
            self._open()
        if len(tokens):
            self.files[split].write(tokens)
            self.hashes[split].update(tokens)
            self.tokens[split] += len(tokens)
            self.ends[split].append(self.tokens[split])
        self.next_document += 1
        if sum(self.tokens.values()) >= self.shard_tokens:
            self.commit()

    def commit(self) -> None:
        index, files = len(self.shards), {}
        for split in SPLITS:
            file = self.files[split]
            file.flush()
            os.fsync(file.fileno())
            file.close()
            offsets = np.asarray(self.ends[split], np.dtype("<u8")).tobytes()
            write_atomic(self._partial(split, "idx"), offsets)
            for kind, digest in (("bin", self.hashes[split].hexdigest()), ("idx", hashlib.sha256(offsets).hexdigest())):
                name = shard_name(split, index, kind)
                os.replace(self._partial(split, kind), self.out / name)
                files[name] = {"bytes": (self.out / name).stat().st_size, "sha256": digest}
        fsync_dir(self.out)
        documents = self.next_document - self.first_document
        record = {"first_document": self.first_document, "documents": documents, "tokens": dict(self.tokens)}
        self.shards.append(record | {"split_documents": {s: len(self.ends[s]) for s in SPLITS}, "files": files})
        self.files = {}
        self.on_commit()

    def close(self) -> None:
        if self.files:
            self.commit()


def job_of(
    sources: list[Source], tokenizer: Tokenizer, text_column: str, validation_split: float, seed: int, shard_tokens: int
) -> dict[str, Any]:
    """Everything the output is a function of: a dir made from another job is never silently reused."""
    return {
        "version": VERSION,
        "tokenizer": tokenizer.fingerprint,
        "sources": sources_key(sources),
        "text_column": text_column,
        "validation_split": validation_split,
        "seed": seed,
        "shard_tokens": shard_tokens,
    }


def tokenize(
    sources: list[Source],
    tokenizer: Tokenizer,
    out: Path,
    *,
    workers: int = 1,
    text_column: str = "text",
    validation_split: float = DEFAULT_VALIDATION_SPLIT,
    seed: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
) -> tuple[dict[str, Any], str]:
    """Writes (or resumes, or reuses) the tokenized dir `out`; returns its meta and what was done."""
    out = Path(out)
    job = job_of(sources, tokenizer, text_column, validation_split, seed, shard_tokens)
    if (out / META).is_file() and not overwrite:
        meta = read_meta(out, "--out")
        _refuse_another_job(out, meta["job"], job)
        check_all(out, meta, "--out")
        if (out / PROGRESS).exists():  # a run killed between writing meta.json and removing this (read-only: no-op)
            (out / PROGRESS).unlink()
        return meta, "reused"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        where = "is a file" if out.exists() or out.is_symlink() else "is inside a file"
        raise DataError(f"--out: '{out}' {where}, not a folder; tokenize into a new or empty folder") from None
    with _locked(out):
        for path in out.iterdir():
            if _TEMPORARY.fullmatch(path.name) or (overwrite and _OUR_FILES.fullmatch(path.name) and path.name != LOCK):
                path.unlink()
        shards = _committed_shards(out, job)
        status = f"resumed after shard {len(shards) - 1}" if shards else "written"
        dtype = token_dtype(tokenizer.vocab_size)
        save = lambda: write_atomic(out / PROGRESS, json.dumps({"job": job, "shards": shards}, indent=1))
        save()
        writer = ShardWriter(out, dtype, shard_tokens, shards, save)
        split = ValidationSplit(validation_split, seed)
        documents = iter_documents(sources, text_column, writer.next_document)
        with _progress_bar(progress, out) as bar:
            for tokens, lengths in encode_batches(batches(documents), tokenizer, dtype, workers):
                for end, length in zip(np.cumsum(lengths).tolist(), lengths.tolist()):
                    writer.add(tokens[end - length : end], "val" if split(writer.next_document) else "train")
                bar(len(lengths), len(tokens))
        writer.close()
        meta = _meta(job, shards, sources, tokenizer, dtype, text_column, validation_split, seed)
        write_atomic(out / META, json.dumps(meta, indent=1) + "\n")
        (out / PROGRESS).unlink()
    (out / LOCK).unlink(missing_ok=True)
    return meta, status


def tokenize_paths(
    specs: list[str],
    tokenizer: str | Path,
    out: Path,
    hub_config: str | None = None,
    hub_split: str = "train",
    **options,
) -> tuple[dict[str, Any], str]:
    """`nanotron tokenize SOURCE... --tokenizer T --out DIR` as a function (the command, tests and benchmarks make
    their tokenized dirs with it); `options` are `tokenize`'s."""
    inputs = [Path(spec).expanduser() for spec in specs] + [Path(tokenizer).expanduser()]
    check_not_input("--out", Path(out), inputs)  # tokens written into a source would be read back as one
    sources = resolve_sources(specs, hub_config=hub_config, hub_split=hub_split)
    return tokenize(sources, load_tokenizer(tokenizer, what="--tokenizer"), Path(out), **options)


def check_all(out: Path, meta: dict, what: str) -> None:
    """Every file of every shard, by size (see `format.check_files`)."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["shards"]:
        check_files(out, shard["files"], itemsize, what)


def _meta(job, shards, sources, tokenizer, dtype, text_column, validation_split, seed) -> dict[str, Any]:
    totals = {key: {s: sum(shard[key][s] for shard in shards) for s in SPLITS} for key in ("split_documents", "tokens")}
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": {"fingerprint": tokenizer.fingerprint, "path": str(Path(tokenizer.path).resolve())},
        "sources": [s.hub or str(Path(s.spec).expanduser().resolve()) for s in sources],
        "source_files": sum(len(s.files) for s in sources),
        "text_column": text_column,
        "validation_split": validation_split,
        "seed": seed,
        "rows": sum(shard["documents"] for shard in shards),
        "documents": totals["split_documents"],
        "tokens": totals["tokens"],
        "job": job,
        "shards": shards,
    }


def _committed_shards(out: Path, job: dict) -> list[dict]:
    """The shards a previous run of the same job committed and that are still intact, in order."""
    progress = out / PROGRESS
    state = _progress(progress) if progress.is_file() else None
    if state is not None:
        _refuse_another_job(out, state["job"], job)
    else:
        foreign = sorted(p.name for p in out.iterdir() if not _OUR_FILES.fullmatch(p.name))
        if foreign:
            raise DataError(
                f"--out: '{out}' already holds other files ({', '.join(foreign[:3])}); tokenize into a new or "
                "empty folder"
            )
        return []
    shards = []
    for shard in state["shards"]:
        try:
            check_files(out, shard["files"], 1, "--out")
        except DataError:
            break  # from here on the shards are redone
        shards.append(shard)
    return shards


PROGRESS_RECORD = {"job": {}, "shards": [{"files": {}}]}  # what `save` writes: objects where {} stands


def _progress(path: Path) -> dict:
    """An interrupted run's progress file (`PROGRESS_RECORD`), or one line naming it."""
    try:
        state = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError):
        state = None
    if state is not None and records.problem(state, PROGRESS_RECORD) is None:
        return state
    raise DataError(
        f"--out: '{path}' is not the progress file an interrupted tokenize writes; pass --overwrite to rebuild the "
        "folder, or another --out"
    )


def _refuse_another_job(out: Path, before: dict, now: dict) -> None:
    """A dir holding (part of) another tokenization is never mixed with this one, nor silently replaced."""
    names = {"tokenizer": "another tokenizer", "sources": "other source files"}
    differ = [names.get(k, f"{k}={before.get(k)!r}, now {now[k]!r}") for k in now if before.get(k) != now[k]]
    if differ:
        raise DataError(
            f"--out: '{out}' holds the tokens of another input ({'; '.join(differ)}); pass another "
            f"--out, or --overwrite to rebuild it"
        )


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One writer per dir: a second `nanotron tokenize` into it stops at once."""
    with open(out / LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"--out: another process is tokenizing into '{out}' now; wait for it") from None
        yield


@contextlib.contextmanager
def _progress_bar(enabled: bool, out: Path) -> Iterator:
    """On a terminal, tqdm counting documents (docs/s) with the token rate alongside; elsewhere (a job's log, where a
    bar is unreadable) a line every PROGRESS_SECONDS. Either way the command's summary line follows."""
    from tqdm import tqdm

    terminal = enabled and sys.stderr.isatty()
    bar = tqdm(unit=" docs", desc=f"tokenize {out}", disable=not terminal, mininterval=1.0, leave=False)
    started = last_line = time.perf_counter()
    documents = tokens = 0

    def update(new_documents: int, new_tokens: int) -> None:
        nonlocal documents, tokens, last_line
        documents += new_documents
        tokens += new_tokens
        now = time.perf_counter()
        rate = f"{tokens / max(now - started, 1e-9) / 1e6:.2f}M tokens/s"
        if terminal:
            bar.update(new_documents)
            bar.set_postfix_str(rate, refresh=False)
        elif enabled and now - last_line >= PROGRESS_SECONDS:
            last_line = now
            say(f"tokenize {out}: {documents:,} documents, {format_count(tokens)} tokens so far ({rate})")

    try:
        yield update
    finally:
        bar.close()
