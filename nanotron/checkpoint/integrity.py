"""Per-file checksums of a checkpoint (checksums.json, written just before the commit marker, and by
`convert from-hf`), verified before anything is loaded.

Same-size bit rot (a flipped bit in a shard) passes every size check and loads silently; a 128-bit XXH3 per
file catches it. XXH3 (the `xxhash` package, which `datasets` already depends on) hashes faster than zlib's
CRC-32 and sha256 (benchmarks/RESULTS.md, "Checkpoint checksums"): bit rot needs detection, not a cryptographic
hash (untrusted input is handled by safe_io's allow-list reading). The work is spread: with W ranks each hashes
every W-th shard file, so a rank hashes ~1/W of the checkpoint (a 70B model's ~1 TB of weights and AdamW state on
512 ranks: ~2 GB), and one small all-gather of the results per save or load is the only communication.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist
import xxhash

from nanotron.errors import CheckpointError
from nanotron.io import write_atomic

ALGORITHM = "xxh3_128x16m"  # XXH3-128 over the digests of 16 MiB chunks
CHECKSUM_FILE = "checksums.json"
_CHUNK = 16 * 2**20
_THREADS = min(8, os.cpu_count() or 1)


def file_checksum(path: Path) -> str:
    """XXH3-128 of the file's 16 MiB chunks' XXH3-128 digests: the chunks hash in parallel threads (xxhash
    releases the GIL), so a rank's one large shard file uses every core it has."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def chunk_digest(offset: int) -> bytes:
            return xxhash.xxh3_128(os.pread(f.fileno(), _CHUNK, offset)).digest()

        with ThreadPoolExecutor(min(_THREADS, max(1, -(-size // _CHUNK)))) as pool:
            digests = list(pool.map(chunk_digest, range(0, size, _CHUNK)))
    return f"{ALGORITHM}:{xxhash.xxh3_128(b''.join(digests)).hexdigest()}"


def shard_files(folder: Path) -> list[str]:
    """The DCP data files of a checkpoint dir, in a fixed order every rank agrees on."""
    return sorted(p.name for p in folder.glob("*.distcp"))


def _share(names: list[str]) -> list[str]:
    """This rank's part of `names` (all of them without a process group)."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _gather(local: dict) -> list[dict]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [local]
    out: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(out, local)
    return out


def shard_checksums(folder: Path) -> dict[str, str]:
    """Checksums of every shard file, hashed cooperatively: a collective when distributed."""
    sums: dict[str, str] = {}
    for part in _gather({name: file_checksum(folder / name) for name in _share(shard_files(folder))}):
        sums |= part
    return sums


def checkpoint_files(folder: Path) -> list[str]:
    """Every file under `folder` but the manifest itself, as sorted relative POSIX paths: one directory listing
    (no stat per file), what the manifest must list exactly."""
    names = []
    for root, _, files in os.walk(folder):
        names += [(Path(root) / name).relative_to(folder).as_posix() for name in files]
    return sorted(name for name in names if name != CHECKSUM_FILE)


def write(folder: Path, shard_sums: dict[str, str]) -> None:
    """checksums.json, the manifest: the shards' sums plus those of every other file now in `folder` (index,
    config, tokenizer, trainer_state.json), hashed here."""
    sums = dict(shard_sums)
    for name in checkpoint_files(folder):
        if name not in sums:
            sums[name] = file_checksum(folder / name)
    write_atomic(folder / CHECKSUM_FILE, json.dumps(sums, indent=1, sort_keys=True))


def saved(folder: Path, allow_missing: bool = False, override: str = "") -> dict[str, str] | None:
    """The checksums saved with `folder`, which must list every file in it (files it lists that are missing are
    `verify`'s to find). A checkpoint without them (written before checksums existed, made by hand, or with the
    file deleted), or with files they leave out, is refused unless `allow_missing` (then None, or the sums of the
    files listed: the others go unchecked); `override` names the option that allows it, for the message."""
    file = folder / CHECKSUM_FILE
    if not file.is_file():
        if allow_missing:
            return None
        raise CheckpointError(
            f"'{file}' is missing, so the checkpoint's files cannot be checked for corruption; restore it, or "
            f"read the checkpoint unchecked with {override or 'the allow_unverified option'}"
        )
    try:
        sums = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"'{file}' is unreadable ({type(error).__name__}); the checkpoint is damaged") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise CheckpointError(f"'{file}' is not a checksum table; the checkpoint is damaged")
    unlisted = [name for name in checkpoint_files(folder) if name not in sums]
    if unlisted and not allow_missing:
        more = f" (nor are {len(unlisted) - 1} other files)" if len(unlisted) > 1 else ""
        raise CheckpointError(
            f"'{folder / unlisted[0]}' is not in its manifest '{file}'{more}, so it cannot be checked for corruption; "
            f"remove it if it does not belong to the checkpoint, or read the checkpoint unchecked with "
            f"{override or 'the allow_unverified option'}"
        )
    return sums


def verify(folder: Path, expected: dict[str, str], names: list[str] | None = None) -> None:
    """Raises CheckpointError naming the first file whose checksum differs; a collective when distributed
    and `names` is None (every rank checks its share of all listed files, and all agree on the outcome)."""
    shared = names is None
    todo = _share(sorted(expected)) if shared else [n for n in names if n in expected]
    problem = next((p for name in todo if (p := _problem(folder, name, expected[name]))), None)
    found = [p for p in (_gather({"problem": problem}) if shared else [{"problem": problem}]) if p["problem"]]
    if found:
        raise CheckpointError(found[0]["problem"] + "; use another checkpoint")


def _problem(folder: Path, name: str, checksum: str) -> str | None:
    """What is wrong with the file `name` of `folder` against its `checksum`, if anything. The name is read from the
    manifest, so untrusted: shown quoted (a newline in it stays on the line), refused outside the folder."""
    file = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return f"'{folder}' lists a checksummed file outside its folder ({name!r}); refusing to read it"
    try:
        if not file.is_file():
            return f"{str(file)!r} is missing: the checkpoint '{folder}' is incomplete"
        if file_checksum(file) != checksum:
            return f"{str(file)!r} is corrupt (its {ALGORITHM} checksum differs from the one saved with it)"
    except OSError as error:  # a name too long, an I/O error
        return f"{str(file)!r} is unreadable ({error.strerror})"
    return None


def check(folder: Path, allow_missing: bool = False, override: str = "", alone: bool = False) -> None:
    """Every file of `folder` against its manifest (see `saved` and `verify`): checked by this process `alone` (a
    single-process reader), else by every rank its share (a collective)."""
    if (sums := saved(folder, allow_missing, override)) is not None:
        verify(folder, sums, names=sorted(sums) if alone else None)
