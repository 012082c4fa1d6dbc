"""`nanotron prepare corpus|tokenizer|task`: the demo's set-up steps (`scripts/prepare_data.sh`): plain-text
plays → JSONL corpus → byte-level BPE tokenizer dir, and the held-out plays → the demo's evaluation task."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nanotron.commands.args import Parser, int_at_least
from nanotron.data.corpus import tokenized_dir
from nanotron.data.demo import held_out_texts, next_words_items, read_jsonl_texts, write_corpus
from nanotron.errors import ConfigError, DataError, run_command
from nanotron.io import check_new_folder, check_not_input, check_writable_file, write_atomic
from nanotron.tokenize.bpe import EOS_TOKEN, train_tokenizer

# A byte-level BPE holds the 256 bytes and EOS at least (a smaller --vocab-size silently gave 257). The tokenizers
# trainer allocates per requested entry up front (1e11 aborted the process); 2**20 is four times the largest
# vocabularies in use (~256k).
VOCAB_SIZES = (257, 1 << 20)
JSONL_CORPUS = 'a JSONL corpus, one {"text": ...} object a line (`nanotron prepare corpus` writes one)'


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    parser = Parser(prog="nanotron prepare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="text files (one document each) -> JSONL corpus")
    corpus.add_argument("text_files", type=Path, nargs="+", metavar="TEXT_FILE")
    corpus.add_argument("--out", type=Path, required=True, help="the JSONL file to write (replaced if it exists)")
    tok = sub.add_parser("tokenizer", help="JSONL corpus -> byte-level BPE tokenizer dir")
    tok.add_argument("corpus", type=Path, metavar="CORPUS")
    tok.add_argument("--out", type=Path, required=True, help="a new or empty folder for the tokenizer")
    tok.add_argument("--vocab-size", type=int, default=8192, help=f"from {VOCAB_SIZES[0]} to {VOCAB_SIZES[1]}")
    task = sub.add_parser("task", help="held-out plays -> a multiple-choice JSONL task (the demo evaluation)")
    task.add_argument("corpus", type=Path, metavar="CORPUS")
    task.add_argument("--tokenized", type=Path, required=True, help="its `nanotron tokenize` output dir")
    task.add_argument("--out", type=Path, required=True, help="the JSONL task to write (replaced if it exists)")
    task.add_argument("--items", type=int_at_least(1), default=400)
    args = parser.parse_args(argv)
    _check(args)
    start = time.perf_counter()
    if args.command == "task":
        texts = held_out_texts(args.corpus, args.tokenized)
        items = next_words_items(texts, args.items)
        write_atomic(args.out, "".join(json.dumps(item) + "\n" for item in items))
        print(f"task: {len(items)} items from {len(texts)} held-out documents written to {args.out}")
        return 0
    if args.command == "corpus":
        docs = write_corpus(args.text_files, args.out)
        size_mb = args.out.stat().st_size / 1e6
        print(f"corpus: wrote {docs} documents ({size_mb:.1f} MB) to {args.out} in {time.perf_counter() - start:.1f} s")
    else:
        texts = read_jsonl_texts(args.corpus)
        tokenizer = train_tokenizer(texts, args.out, args.vocab_size)
        print(
            f"tokenizer: trained byte-level BPE, vocab {tokenizer.get_vocab_size()}, eos {EOS_TOKEN!r}, "
            f"on {len(texts)} documents, saved to {args.out}/ in {time.perf_counter() - start:.1f} s"
        )
    return 0


def _check(args: argparse.Namespace) -> None:
    """Inputs that exist and outputs that replace none of them, before any work. A file output (corpus, task) is
    replaced, as re-running the command means; a folder output (tokenizer) must be new or empty: it may hold the
    tokenizer that tokenized data was built with."""
    if args.command == "corpus":
        inputs = [_input_file("TEXT_FILE", path, "a text file (one document)") for path in args.text_files]
    else:
        inputs = [_input_file("CORPUS", args.corpus, JSONL_CORPUS)]
    if args.command == "task":
        inputs.append(tokenized_dir("--tokenized", str(args.tokenized), "TOKENIZER"))
    if args.command == "tokenizer":
        low, high = VOCAB_SIZES
        if not low <= args.vocab_size <= high:
            raise ConfigError(
                f"--vocab-size: expected an integer from {low} to {high} (a byte-level BPE holds the 256 bytes and "
                f"EOS), got {args.vocab_size}"
            )
    check_not_input("--out", args.out, inputs)  # before check_writable_file makes its folder
    if args.command != "tokenizer":
        check_writable_file("--out", args.out)
    elif not _unfinished_tokenizer(args.out):
        check_new_folder(args.out, "--out")


def _unfinished_tokenizer(folder: Path) -> bool:
    """A folder an interrupted `prepare tokenizer` left: some of the tokenizer's files (tokenizer.json, written
    last, not among them) and write_atomic's temporary files, nothing else. Training again finishes it."""
    if not folder.is_dir() or (folder / "tokenizer.json").exists():
        return False
    side_files = {"tokenizer_config.json", "special_tokens_map.json"}
    return all(path.name in side_files or path.name.startswith(".") for path in folder.iterdir())


def _input_file(name: str, path: Path, expected: str) -> Path:
    if not path.is_file():
        problem = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise DataError(f"{name}: '{path}' {problem}; expected {expected}")
    return path
