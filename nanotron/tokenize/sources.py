"""Documents of the sources `nanotron tokenize` reads: local .txt/.jsonl/.json/.parquet files or folders, or a
Hugging Face Hub dataset streamed when online. Local files are read here directly (so a bad row is named by file
and line), one document at a time, in a fixed order: sources as given, a folder's files sorted by path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from nanotron.errors import DataError
from nanotron.tokenize.tokenizer import PREPARE_HINT

KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TRUE = ("1", "true", "yes", "on")


LOCAL_FIX = "pass a local .txt/.jsonl/.json/.parquet file or folder"


@dataclass
class Source:
    """One SOURCE argument: its local files in reading order, or a hub dataset."""

    spec: str
    files: list[Path] = field(default_factory=list)
    hub: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"

    def fingerprint(self) -> list[Any]:
        """What the documents are a function of: each file's path, size and mtime, or the hub coordinates."""
        if self.hub:
            return [self.hub, self.hub_config, self.hub_split]
        return [[str(f.resolve()), (s := f.stat()).st_size, s.st_mtime_ns] for f in self.files]

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def resolve_sources(specs: list[str], hub_config: str | None = None, hub_split: str = "train") -> list[Source]:
    """Local files (a folder's, sorted, hidden ones skipped) or hub names checked to be reachable."""
    sources = []
    for spec in specs:
        root = Path(spec).expanduser()
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(
                f
                for f in root.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts)
            )
        elif is_hub_name(spec):
            check_hub_reachable(spec)
            sources.append(Source(spec, hub=spec, hub_config=hub_config, hub_split=hub_split))
            continue
        else:
            problem = "is neither a file nor a folder" if root.exists() else "does not exist"
            hint = f"{LOCAL_FIX}, or an online hub dataset name, or {PREPARE_HINT}"
            raise DataError(f"SOURCE: '{spec}' {problem}; {hint}")
        unknown = sorted({f.suffix or f.name for f in files if f.suffix not in KINDS})
        if unknown or not files:
            found = f"found {unknown}" if unknown else "it holds no files"
            raise DataError(f"SOURCE: '{spec}' must hold .txt, .jsonl, .json or .parquet files; {found}")
        sources.append(Source(spec, files))
    return sources


def is_hub_name(spec: str) -> bool:
    """`org/name` that is no local path (a missing `data/corpus.jsonl` is a typo, not a dataset name)."""
    root = Path(spec).expanduser()
    return bool(_HUB_NAME.fullmatch(spec)) and root.suffix not in KINDS and not Path(root.parts[0]).exists()


def sources_key(sources: list[Source]) -> str:
    """One hash of every source's fingerprint: a changed, added or removed file changes it."""
    text = json.dumps([[s.spec, s.fingerprint()] for s in sources])
    return hashlib.sha256(text.encode()).hexdigest()


def check_hub_reachable(name: str) -> None:
    """A hub dataset offline fails at once, rather than after `datasets`' retries."""
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "").lower() in _TRUE]
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    reason = f"{offline[0]} is set" if offline else None if _reachable(host) else f"{host}:443 is unreachable"
    if reason:
        raise DataError(
            f"SOURCE: '{name}' is not a local file or folder, and the Hugging Face Hub is offline "
            f"({reason}); {LOCAL_FIX}, or {PREPARE_HINT}"
        )


def _reachable(host: str, timeout: float = 3.0) -> bool:
    """A TCP connect in a daemon thread, so a slow DNS lookup can't stall start-up beyond `timeout`."""
    ok = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def iter_documents(sources: list[Source], column: str, start: int = 0) -> Iterator[str]:
    """Every document's text in order, from document `start` on (earlier files are skipped by counting rows)."""
    for source in sources:
        if source.hub:
            start = yield from _hub_documents(source, column, start)
            continue
        for path in source.files:
            kind = KINDS[path.suffix]
            if start:
                rows = _count_rows(path, kind)
                if rows <= start:
                    start -= rows
                    continue
            yield from _READERS[kind](path, column, start)
            start = 0


def _text(value: Any, where: str, column: str) -> str:
    if isinstance(value, str):
        return value
    shown = json.dumps(value, default=repr)
    shown = (shown if len(shown) <= 40 else shown[:37] + "...") + (
        "" if value is None else f" ({type(value).__name__})"
    )
    raise DataError(
        f"--text_column: '{column}' of {where} holds {shown}, expected a string; fix or drop that row, or "
        "name the text column"
    )


def _field(row: Any, where: str, column: str) -> str:
    if not isinstance(row, dict):
        raise DataError(f"{where} is a JSON {type(row).__name__}, expected an object with '{column}'")
    if column not in row:
        raise DataError(
            f"--text_column: '{column}' is not a field of {where} (its fields: {sorted(row)}); "
            "name the text column with --text_column"
        )
    return _text(row[column], where, column)


def _text_documents(path: Path, column: str, skip: int) -> Iterator[str]:
    """A .txt file is one document, byte for byte (no newline translation)."""
    try:
        yield path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"SOURCE: '{path}' is not UTF-8 text (byte {e.start}); re-encode it") from None


def jsonl_documents(path: Path, column: str, skip: int = 0) -> Iterator[str]:
    """One JSON object per non-blank line (also how `nanotron prepare` reads a JSONL corpus)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if skip:
                skip -= 1
                continue
            where = f"'{path}' line {number}"
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as e:  # also bytes that are not UTF-8, or nesting too deep
                raise DataError(f"{where} is not valid JSON ({e})") from None
            yield _field(row, where, column)


def _json_documents(path: Path, column: str, skip: int) -> Iterator[str]:
    """A JSON array of objects, or JSON lines under a .json name."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from jsonl_documents(path, column, skip)
        return
    try:
        rows = json.loads(path.read_bytes())
    except ValueError as e:
        raise DataError(f"SOURCE: '{path}' is not valid JSON ({e})") from None
    if not isinstance(rows, list):
        raise DataError(f"SOURCE: '{path}' is a JSON {type(rows).__name__}, expected an array of objects")
    for number, row in enumerate(rows[skip:], skip):
        yield _field(row, f"'{path}' item {number}", column)


def _parquet_documents(path: Path, column: str, skip: int) -> Iterator[str]:
    """The text column only, batch by batch; whole row groups before `skip` are never read."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several unrelated types for a bad file
        raise DataError(f"SOURCE: '{path}' is not a readable parquet file ({e})") from None
    names = file.schema_arrow.names
    if column not in names:
        raise DataError(
            f"--text_column: '{column}' is not a column of '{path}' (its columns: {names}); "
            "name the text column with --text_column"
        )
    groups, row = [], 0
    for group in range(file.num_row_groups):
        rows = file.metadata.row_group(group).num_rows
        if row + rows > skip:
            groups.append(group)
        else:
            row += rows
    skip -= row
    for batch in file.iter_batches(columns=[column], row_groups=groups, batch_size=1024):
        for value in batch.column(0).to_pylist():
            if skip:
                skip -= 1
            else:
                yield _text(value, f"'{path}' row {row}", column)
            row += 1


def _count_rows(path: Path, kind: str) -> int:
    """Documents in a file, for skipping it whole on resume: cheap (no parsing) except for JSON arrays."""
    if kind == "text":
        return 1
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if kind == "json":
        return _count_json(path)
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _count_json(path: Path) -> int:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return _count_rows(path, "jsonl")
    rows = json.loads(path.read_bytes())
    return len(rows) if isinstance(rows, list) else 0


def _hub_documents(source: Source, column: str, skip: int) -> Iterator[str]:
    """Streamed, never downloaded whole; rows before `skip` are streamed past. Returns how many of `skip` are
    left for the sources after it."""
    import datasets

    number = 0
    try:
        rows = datasets.load_dataset(source.hub, source.hub_config, split=source.hub_split, streaming=True)
        for number, row in enumerate(rows, 1):
            if number > skip:
                yield _field(row, f"hub dataset '{source.hub}' row {number - 1}", column)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        message = f"`datasets` could not stream '{source.hub}' ({type(e).__name__}: {e})"
        raise DataError(f"SOURCE: {message}") from None
    return max(0, skip - number)


_READERS = {"text": _text_documents, "jsonl": jsonl_documents, "json": _json_documents, "parquet": _parquet_documents}
