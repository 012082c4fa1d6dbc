"""Training data: tokenized dirs (memory-mapped shards) → weighted blend → keyed O(1)-memory shuffle →
dp-sharded loader. `nanotron tokenize` writes the dirs; `open_corpus` opens them. The loader (torch's DataLoader)
is `nanotron.data.loader`, named by its importers: the package itself loads no torch, so the commands that only
read or write text (`nanotron prepare`) start without it."""

from nanotron.data.corpus import Corpus, check_corpus_size, open_corpus

__all__ = ["Corpus", "check_corpus_size", "open_corpus"]
