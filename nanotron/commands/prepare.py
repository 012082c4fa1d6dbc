"""`nanotron prepare corpus|tokenizer|task`: the demo's set-up steps (`scripts/prepare_data.sh`): plain-text
plays → JSONL corpus → byte-level BPE tokenizer dir, and the held-out plays → the demo's evaluation task."""

from __future__ import annotations

import json
import time
from pathlib import Path

from nanotron.commands.args import Parser
from nanotron.data.demo import held_out_texts, next_words_items, read_jsonl_texts, write_corpus
from nanotron.errors import run_command
from nanotron.io import write_atomic
from nanotron.tokenize.bpe import EOS_TOKEN, train_tokenizer


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    parser = Parser(prog="nanotron prepare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="text files (one document each) -> JSONL corpus")
    corpus.add_argument("text_files", type=Path, nargs="+")
    corpus.add_argument("--out", type=Path, required=True)
    tok = sub.add_parser("tokenizer", help="JSONL corpus -> byte-level BPE tokenizer dir")
    tok.add_argument("corpus", type=Path)
    tok.add_argument("--out", type=Path, required=True)
    tok.add_argument("--vocab-size", type=int, default=8192)
    task = sub.add_parser("task", help="held-out plays -> a multiple-choice JSONL task (the demo evaluation)")
    task.add_argument("corpus", type=Path)
    task.add_argument("--tokenized", type=Path, required=True, help="its `nanotron tokenize` output dir")
    task.add_argument("--out", type=Path, required=True)
    task.add_argument("--items", type=int, default=400)
    args = parser.parse_args(argv)
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
