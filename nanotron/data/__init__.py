"""Training data: tokenized dirs (memory-mapped shards) → weighted blend → keyed O(1)-memory shuffle →
dp-sharded loader. `nanotron tokenize` writes the dirs; `open_corpus` opens them."""

from nanotron.data.corpus import Corpus, check_corpus_size, open_corpus
from nanotron.data.loader import StepSampler, TrainSamples, build_train_loader, eval_batches, loader_batches

__all__ = [
    "Corpus",
    "StepSampler",
    "TrainSamples",
    "build_train_loader",
    "check_corpus_size",
    "eval_batches",
    "loader_batches",
    "open_corpus",
]
