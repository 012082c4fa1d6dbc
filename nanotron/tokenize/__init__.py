"""Offline, parallel tokenization: sources → a tokenized dir of sharded token files (`nanotron tokenize`).

Training only memory-maps what this writes (`nanotron.data`); nothing here imports torch, so the tokenizer
worker processes start in a fraction of a second.
"""
