"""`nanotron tokenize SOURCE... --tokenizer T --out DIR [--workers N]`: sources → a tokenized dir for training.

SOURCE is a local .txt (one document per file), .jsonl/.json or .parquet file or a folder of them (read in sorted
order), or a Hugging Face Hub dataset name (streamed; needs the network). DIR gets sharded token files, a
document index per shard and meta.json; point `data.path` (or a `[[data.datasets]]` entry) at it. Killed and
re-run, it resumes at the first unfinished shard; run again on a finished DIR, it checks and reuses it.
`--verify DIR` reads every file of a finished DIR and checks it against the sha256 meta.json records.
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import sys
import time
from pathlib import Path

from nanotron.commands.args import Parser
from nanotron.errors import ConfigError, DataError, run_command
from nanotron.signals import ABORT_EXIT_CODE
from nanotron.tokenize.encode import available_cpus
from nanotron.tokenize.format import check_files, read_meta, summary
from nanotron.tokenize.writer import DEFAULT_SHARD_TOKENS, DEFAULT_VALIDATION_SPLIT, tokenize_paths


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every flag's default."""


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="nanotron tokenize", description=__doc__, formatter_class=_Help)
    p.add_argument("sources", nargs="*", metavar="SOURCE", help="files, folders or hub dataset names, in order")
    p.add_argument("--tokenizer", help="tokenizer.json file or Hugging Face tokenizer dir (data.tokenizer)")
    p.add_argument("--out", type=Path, help="the tokenized dir to write (data.path of the run)")
    p.add_argument("--workers", type=int, default=available_cpus(), help="tokenizer processes, one core each")
    p.add_argument("--text_column", default="text", help="field holding the text in .jsonl/.json/.parquet/hub rows")
    p.add_argument(
        "--validation_split",
        type=float,
        default=DEFAULT_VALIDATION_SPLIT,
        help="fraction of documents held out (0: none)",
    )
    p.add_argument("--seed", type=int, default=0, help="which documents are held out for validation")
    p.add_argument(
        "--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="a shard closes at the first document past this"
    )
    p.add_argument("--hub_config", default=None, help="configuration name of a hub dataset")
    p.add_argument("--hub_split", default="train", help="split of a hub dataset to read")
    p.add_argument("--overwrite", action="store_true", help="rebuild DIR even if it holds another tokenization")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verify", type=Path, metavar="DIR", help="check every file of DIR against its sha256, then exit")
    return p


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.verify:
        return verify(args.verify)
    for flag, ok, expected in (
        ("SOURCE", args.sources, "at least one source"),
        ("--tokenizer", args.tokenizer, "a tokenizer path"),
        ("--out", args.out, "an output folder"),
        ("--workers", args.workers >= 1, "at least 1"),
        ("--validation_split", 0.0 <= args.validation_split < 1.0, "a fraction in [0, 1)"),
        ("--shard_tokens", args.shard_tokens >= 1, "at least 1"),
    ):
        if not ok:
            raise ConfigError(f"{flag}: expected {expected}; see `nanotron tokenize --help`")
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)  # a preempted job stops as cleanly as Ctrl-C
    try:
        meta, status = tokenize_paths(
            args.sources,
            args.tokenizer,
            args.out,
            hub_config=args.hub_config,
            hub_split=args.hub_split,
            workers=args.workers,
            text_column=args.text_column,
            validation_split=args.validation_split,
            seed=args.seed,
            shard_tokens=args.shard_tokens,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except KeyboardInterrupt:
        print(f"interrupted: {args.out} keeps its committed shards; re-run the same command to resume", file=sys.stderr)
        return ABORT_EXIT_CODE
    print(f"tokenize: {summary(meta)} in {args.out} ({status} in {time.perf_counter() - started:.1f} s)")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def verify(directory: Path) -> int:
    """Reads and hashes every file: what start-up skips (sizes only) because it scales with the corpus."""
    meta = read_meta(directory, "--verify")
    for shard in meta["shards"]:
        check_files(directory, shard["files"], 1, "--verify")
        for name, record in shard["files"].items():
            digest = hashlib.sha256()
            with open(directory / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            if digest.hexdigest() != record["sha256"]:
                raise DataError(
                    f"--verify: '{directory / name}' does not match its sha256 in meta.json; re-run tokenize"
                )
    print(f"verify: {directory} is intact: {summary(meta)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
