"""The run's data: data.path, or a weighted blend of `[[data.datasets]]`, each a tokenized dir (`nanotron tokenize`
writes them before training: nothing heavy runs while the other ranks wait).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nanotron.config import Config, TrainingConfig
from nanotron.data.order import Blend
from nanotron.data.tokens import TokenizedData, open_tokenized
from nanotron.errors import ConfigError, DataError
from nanotron.tokenize.format import is_tokenized
from nanotron.tokenize.sources import is_hub_name
from nanotron.tokenize.tokenizer import PREPARE_HINT, load_tokenizer


@dataclass
class Corpus:
    """The datasets of a run with their blend weights; samples are seq_len + 1 tokens (inputs + targets)."""

    datasets: list[TokenizedData]
    weights: list[float]
    seq_len: int
    num_workers: int = 0  # data.num_workers, the default of build_train_loader
    eos_id: int | None = None  # the tokenizer's end-of-document token (document masking splits at it)
    vocab_size: int | None = None  # the tokenizer's: every token id read is checked against it
    blend: Blend = field(init=False)

    def __post_init__(self) -> None:
        self.blend = Blend(self.weights)

    @property
    def num_train_samples(self) -> int:
        return sum(d.train.num_samples(self.seq_len) for d in self.datasets)

    @property
    def num_val_samples(self) -> int:
        return sum(d.val.num_samples(self.seq_len) for d in self.datasets)


def open_corpus(cfg: Config) -> Corpus:
    """The tokenizer and every dataset opened, then checked against one global batch and one evaluation pass,
    before a model is built. O(shards) stats at start-up, nothing read."""
    data = cfg.data
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, {data.tokenizer}); raise model.vocab_size"
        )
    entries = [(f"data.datasets[{i}].path", d.path, d.weight) for i, d in enumerate(data.datasets)]
    entries = entries or [("data.path", data.path, 1.0)]
    # One rank per node stats every shard (a node may see another filesystem); the others check each as they open it.
    checks_all = os.environ.get("LOCAL_RANK", "0") == "0"
    datasets = [
        open_tokenized(tokenized_dir(what, path, data.tokenizer), what, tokenizer, checks_all)
        for what, path, _ in entries
    ]
    corpus = Corpus(
        datasets,
        [weight for *_, weight in entries],
        cfg.training.seq_len,
        data.num_workers,
        tokenizer.eos_id,
        tokenizer.vocab_size,
    )
    check_corpus_size(corpus, cfg.training)
    return corpus


def tokenized_dir(what: str, path: str, tokenizer: str) -> Path:
    """The tokenized dir config key `what` names, or one line with the `nanotron tokenize` command that makes it."""
    root = Path(path).expanduser()
    if is_tokenized(root):
        return root
    if not root.exists() and not is_hub_name(path):
        raise DataError(
            f"{what}: '{path}' does not exist; point it at a `nanotron tokenize` output dir, or {PREPARE_HINT}"
        )
    raise DataError(
        f"{what}: '{path}' is not a tokenized dir; tokenize it before training: "
        f"`nanotron tokenize {path} --tokenizer {tokenizer} --out DIR`, then set {what}=DIR"
    )


def check_corpus_size(corpus: Corpus, training: TrainingConfig) -> None:
    """Each dataset holds its share of one global batch, and of the validation samples evaluation reads: checked
    as soon as the data is known, before a model is built (and by the Slurm launcher before submitting)."""
    shares = corpus.blend.counts(training.global_batch_size)
    for dataset, weight, share in zip(corpus.datasets, corpus.weights, shares):
        have = dataset.train.num_samples(corpus.seq_len)
        if have < max(share, 1):
            of = (
                "one global batch"
                if len(shares) == 1
                else f"its share ({share}, weight {weight:g}) of one global batch"
            )
            raise DataError(
                f"{dataset.what}: the train split has {have} samples of seq_len+1 tokens, fewer than {of} "
                f"(training.global_batch_size={training.global_batch_size}); use more data, or lower "
                "training.global_batch_size or training.seq_len"
            )
    if training.eval_interval > 0:
        check_validation(corpus, training)


def check_validation(corpus: Corpus, training: TrainingConfig) -> None:
    """Evaluation reads the first eval_steps global batches of the blended validation samples, in order."""
    needed = training.eval_steps * training.global_batch_size
    for dataset, share in zip(corpus.datasets, corpus.blend.counts(needed)):
        have = dataset.val.num_samples(corpus.seq_len)
        if have >= share:
            continue
        fix = f"re-run `nanotron tokenize` for '{dataset.path}' with a larger --validation_split"
        of = "" if len(corpus.datasets) == 1 else f" of {dataset.what} (its share: {share} samples)"
        raise DataError(
            f"{dataset.what}: the validation split{of} has {have} samples of seq_len+1 tokens, but evaluation needs "
            f"training.eval_steps * global_batch_size = {training.eval_steps} * {training.global_batch_size} = "
            f"{needed}; lower training.eval_steps, {fix}, or set training.eval_interval = 0"
        )
