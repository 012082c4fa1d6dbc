"""Set-up helpers for the demo corpus: plain-text plays → JSONL corpus → byte-level BPE tokenizer dir.

Called by `scripts/prepare_data.sh`; the tokenizer dir is written in Hugging Face layout by hand so that
neither set-up nor training needs `transformers`, while `AutoTokenizer.from_pretrained` still loads it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanotron.errors import run_command
from nanotron.io import write_atomic

EOS_TOKEN = "<|endoftext|>"
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """The work without Project Gutenberg's license header and footer, when the markers are present."""
    if start := _GUTENBERG_START.search(text):
        text = text[start.end() :]
    if end := _GUTENBERG_END.search(text):
        text = text[: end.start()]
    return text.strip() + "\n"


def write_corpus(text_files: Iterable[Path], out: Path) -> int:
    """One JSON object {"text": ...} per file, in sorted file order; returns the number of documents."""
    files = sorted(text_files)
    lines = [json.dumps({"text": strip_gutenberg(f.read_text(encoding="utf-8", errors="replace"))}) for f in files]
    write_atomic(out, "\n".join(lines) + "\n")
    return len(lines)


def read_jsonl_texts(path: Path, text_column: str = "text") -> list[str]:
    """Documents of a JSONL corpus, for training the tokenizer on the very text the model will read."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[text_column] for line in f if line.strip()]


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 8192) -> Tokenizer:
    """Byte-level BPE (GPT-2 style: any byte encodable, exact decode) with one special token, EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
    }
    write_atomic(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    write_atomic(out_dir / "special_tokens_map.json", json.dumps({"eos_token": EOS_TOKEN}, indent=2) + "\n")
    write_atomic(out_dir / "tokenizer.json", tokenizer.to_str())
    return tokenizer


_SPEAKER = re.compile(r"^[A-Z][A-Z .,'&-]*\.$")  # "CAESAR." or "FIRST CITIZEN."


def _speech_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the spoken lines of a play: not blank, not a speaker's name, not a stage direction."""
    lines = text.splitlines()
    return [
        (n, line.strip())
        for n, line in enumerate(lines)
        if line.strip() and not _SPEAKER.match(line.strip()) and not line.lstrip().startswith("[")
    ]


def next_words_items(texts: list[str], n_items: int, seed: int = 0) -> list[dict]:
    """Which of four endings completes a line of the play: the context is the two lines before it (speaker
    names included) and the line's first half; the choices are its second half and the second halves of three
    other lines of the same play with as many words (+-1). Deterministic for a given seed."""
    rng = random.Random(seed)
    candidates = []
    for play, text in enumerate(texts):
        lines = text.splitlines()
        for number, line in _speech_lines(text):
            words = line.split()
            if len(words) >= 6 and number >= 2:
                cut = len(words) // 2
                before = "\n".join(line.strip() for line in lines[max(0, number - 3) : number] if line.strip())
                context = (before + "\n" if before else "") + " ".join(words[:cut])
                candidates.append((play, context, " ".join(words[cut:])))
    rng.shuffle(candidates)
    items = []
    by_play_length: dict[tuple[int, int], list[str]] = {}
    for play, _, ending in candidates:
        by_play_length.setdefault((play, len(ending.split())), []).append(ending)
    for play, context, ending in candidates:
        length = len(ending.split())
        pool = sorted({e for d in (-1, 0, 1) for e in by_play_length.get((play, length + d), []) if e != ending})
        if len(pool) < 3:
            continue
        choices = rng.sample(pool, 3)
        gold = rng.randrange(4)
        choices.insert(gold, ending)
        items.append({"context": context, "choices": choices, "gold": gold})
        if len(items) == n_items:
            break
    return items


def held_out_texts(corpus: Path, tokenized: Path) -> list[str]:
    """The documents of `corpus` that `nanotron tokenize` put in the validation split of `tokenized` (never
    trained on): the same keyed choice, read from its meta.json."""
    from nanotron.tokenize.writer import ValidationSplit

    meta = json.loads((tokenized / "meta.json").read_text())
    held_out = ValidationSplit(meta["validation_split"], meta["seed"])
    return [text for index, text in enumerate(read_jsonl_texts(corpus, meta["text_column"])) if held_out(index)]


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron.prepare", description=__doc__)
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


if __name__ == "__main__":
    sys.exit(main())
