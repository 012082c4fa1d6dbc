"""Training data: tokenized dirs (memory-mapped shards) → weighted blend → keyed O(1)-memory shuffle →
dp-sharded loader. `nanotron.tokenize` writes the dirs; `prepare_data` opens them (tokenizing small raw
corpora first)."""

from nanotron.data.corpus import Corpus, check_corpus_size, prepare_data
from nanotron.data.loader import StepSampler, TrainSamples, build_train_loader, eval_batches, loader_batches

__all__ = [
    "Corpus",
    "StepSampler",
    "TrainSamples",
    "build_train_loader",
    "check_corpus_size",
    "eval_batches",
    "loader_batches",
    "prepare_data",
]
