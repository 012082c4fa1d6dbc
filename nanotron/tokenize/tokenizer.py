"""Tokenizers: a `tokenizer.json` (or a Hugging Face tokenizer dir) and its EOS id, without transformers."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from nanotron.errors import DataError

PREPARE_HINT = "run `bash scripts/prepare_data.sh` for the demo corpus"
EOS_FALLBACKS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
TOKENIZER_FILES += ("chat_template.jinja",)


@dataclass
class Tokenizer:
    """A `tokenizers` tokenizer and its EOS id: all training needs, without importing transformers."""

    backend: tokenizers.Tokenizer
    eos_id: int
    vocab_size: int  # largest id + 1, so the embedding can hold every id
    path: Path  # data.tokenizer as given: a tokenizer.json file or a dir holding one
    fingerprint: str  # hash of tokenizer.json and the EOS id: identifies what token ids mean

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: str | Path, what: str = "data.tokenizer") -> Tokenizer:
    """Loads `tokenizer.json` (or a dir with one); EOS comes from tokenizer_config.json or a known name."""
    given = Path(path).expanduser()
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
        raise DataError(
            f"{what}: no tokenizer.json at '{path}'; point {what} at a tokenizer.json file "
            f"or a dir holding one, or {PREPARE_HINT} and its tokenizer"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{what}: '{file}' is not a tokenizer.json (not UTF-8 text: {e})") from None
    try:
        backend = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise DataError(f"{what}: '{file}' is not a valid tokenizer.json ({e})") from None
    eos = _eos_token(file.parent, backend, what)
    eos_id = backend.token_to_id(eos)
    vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    fingerprint = hashlib.sha256(f"{text}\0{eos_id}".encode()).hexdigest()
    return Tokenizer(backend, eos_id, vocab_size, given, fingerprint)


def _eos_token(folder: Path, backend: tokenizers.Tokenizer, what: str) -> str:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = folder / name
        if not config.is_file():
            continue
        try:
            settings = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"{what}: '{config}' is not valid JSON ({e}); fix or remove it") from None
        token = settings.get("eos_token") if isinstance(settings, dict) else None
        token = token.get("content") if isinstance(token, dict) else token
        if token and backend.token_to_id(token) is not None:
            return token
    for token in EOS_FALLBACKS:
        if backend.token_to_id(token) is not None:
            return token
    raise DataError(f"{what}: no EOS token found in '{folder}'; name one with \"eos_token\" in tokenizer_config.json")


def copy_tokenizer(source: Path, dest: Path) -> bool:
    """Copies a tokenizer (a tokenizer.json file, or the HF tokenizer files of a dir) into `dest`."""
    source = Path(source)
    folder = source if source.is_dir() else source.parent
    files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if source.is_file() and source.name != "tokenizer.json":
        files = [f for f in files if f.name != "tokenizer.json"]
    if not files and not source.is_file():
        return False
    dest.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copyfile(file, dest / file.name)
    if source.is_file():
        shutil.copyfile(source, dest / "tokenizer.json")
    return True
