"""Tokenizers and offline, parallel tokenization: loading a tokenizer and its EOS id (`tokenizer`), training a
byte-level BPE (`bpe`), and sources → a tokenized dir of sharded token files (`nanotron tokenize`: `sources`,
`encode`, `writer`, `format`).

Training only memory-maps what this writes (`nanotron.data`); nothing here imports torch, so the tokenizer
worker processes start in a fraction of a second.
"""
