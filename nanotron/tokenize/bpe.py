"""Training a byte-level BPE tokenizer, written as a Hugging Face tokenizer dir by hand so that neither set-up nor
training needs `transformers`, while `AutoTokenizer.from_pretrained` still loads it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanotron.io import write_atomic

EOS_TOKEN = "<|endoftext|>"


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
