"""The demo's data (`scripts/prepare_data.sh`): plain-text plays → a JSONL corpus, and the held-out plays → a
multiple-choice task (which ending completes a line)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from pathlib import Path

from nanotron.errors import DataError
from nanotron.io import write_atomic

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
    """Documents of a JSONL corpus, for training the tokenizer on the very text the model will read: read as
    `nanotron tokenize` reads it (a bad line is one error naming the file and line)."""
    from nanotron.tokenize.sources import jsonl_documents

    return list(jsonl_documents(path, text_column))


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


def held_out_texts(corpus: Path, tokenized: Path, what: str = "--tokenized") -> list[str]:
    """The documents of `corpus` that `nanotron tokenize` put in the validation split of `tokenized` (never
    trained on): the same keyed choice, read from its meta.json; `what` names `tokenized` in errors."""
    from nanotron.tokenize.format import RETOKENIZE, read_meta
    from nanotron.tokenize.writer import ValidationSplit

    meta = read_meta(tokenized, what)
    for field, kind in (("validation_split", (int, float)), ("seed", int), ("text_column", str)):
        if not isinstance(meta.get(field), kind) or isinstance(meta.get(field), bool):
            raise DataError(f"{what}: '{tokenized / 'meta.json'}' has no valid '{field}'; {RETOKENIZE}")
    held_out = ValidationSplit(meta["validation_split"], meta["seed"])
    return [text for index, text in enumerate(read_jsonl_texts(corpus, meta["text_column"])) if held_out(index)]
