"""The run's data: data.path, or a weighted blend of `[[data.datasets]]`, each a tokenized dir.

A small local raw corpus (up to data.max_auto_tokenize_mb) is tokenized at start-up into data.cache_dir, by
global rank 0 and in parallel, with `nanotron tokenize`'s own code; a larger one, or a hub dataset, is refused
with the `nanotron tokenize` command to run beforehand: nothing heavy runs while the other ranks wait.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from nanotron.config import Config, DataConfig, TrainingConfig
from nanotron.data.order import Blend
from nanotron.data.tokens import TokenizedData, open_tokenized
from nanotron.errors import ConfigError, DataError
from nanotron.tokenize.encode import available_cpus
from nanotron.tokenize.format import META, is_tokenized, summary
from nanotron.tokenize.sources import Labels, Source, is_hub_name, resolve_sources
from nanotron.tokenize.tokenizer import Tokenizer, load_tokenizer
from nanotron.tokenize.writer import DEFAULT_SHARD_TOKENS, job_of, tokenize

AUTO_MB_PER_WORKER = 16  # one more tokenizer process per 16 MB: a worker's ~1 s start-up stays a small share


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


def prepare_data(cfg: Config) -> Corpus:
    """The tokenizer and every dataset, opened (and tokenized first when small and raw), then checked against one
    global batch and one evaluation pass, before a model is built. O(shards) stats at start-up, nothing read."""
    data = cfg.data
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, {data.tokenizer}); raise model.vocab_size"
        )
    entries = [(f"data.datasets[{i}].path", d.path, d.weight) for i, d in enumerate(data.datasets)]
    entries = entries or [("data.path", data.path, 1.0)]
    plans = [_plan(what, path, data, tokenizer) for what, path, _ in entries]
    _tokenize_raw(plans, data, tokenizer)
    # One rank per node stats every shard (a node may see another filesystem); the others check each as they open it.
    checks_all = os.environ.get("LOCAL_RANK", "0") == "0"
    datasets = [open_tokenized(dir_, what, tokenizer, checks_all, auto=bool(src)) for what, dir_, src in plans]
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
        key, fix = (
            ("data.validation_split", "raise data.validation_split")
            if dataset.auto
            else (dataset.what, f"re-run `nanotron tokenize` for '{dataset.path}' with a larger --validation_split")
        )
        of = "" if len(corpus.datasets) == 1 else f" of {dataset.what} (its share: {share} samples)"
        raise DataError(
            f"{key}: the validation split{of} has {have} samples of seq_len+1 tokens, but evaluation needs "
            f"training.eval_steps * global_batch_size = {training.eval_steps} * {training.global_batch_size} = "
            f"{needed}; lower training.eval_steps, {fix}, or set training.eval_interval = 0"
        )


def _plan(what: str, path: str, data: DataConfig, tokenizer: Tokenizer) -> tuple[str, Path, list[Source]]:
    """(key, tokenized dir, raw sources to tokenize into it first: none for a tokenized dir)."""
    root = Path(path).expanduser()
    if is_tokenized(root):
        return what, root, []
    command = f"`nanotron tokenize {path} --tokenizer {data.tokenizer} --out DIR`"
    if is_hub_name(path):
        raise DataError(
            f"{what}: '{path}' is not a local path; a Hugging Face Hub dataset is tokenized before training, not "
            f"inside the job: run {command} (it streams the dataset) and set {what}=DIR"
        )
    labels = Labels(
        source=what,
        text_column="data.text_column",
        out="data.cache_dir",
        fix="point it at a `nanotron tokenize` output dir or a small local .txt/.jsonl/.json/.parquet corpus",
    )
    sources = resolve_sources([path], labels, exclude=Path(data.cache_dir))
    megabytes = sum(source.bytes for source in sources) / 1e6
    if megabytes > data.max_auto_tokenize_mb:
        raise DataError(
            f"{what}: '{path}' is {megabytes:.1f} MB of raw text, more than data.max_auto_tokenize_mb="
            f"{data.max_auto_tokenize_mb:g} tokenizes at start-up; tokenize it beforehand, in parallel: {command}, "
            f"and set {what}=DIR (or raise data.max_auto_tokenize_mb)"
        )
    job = job_of(sources, tokenizer, data.text_column, data.validation_split, 0, DEFAULT_SHARD_TOKENS)
    key = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
    return what, Path(data.cache_dir) / f"{root.resolve().name}-{key}", sources


def _tokenize_raw(plans: list[tuple[str, Path, list[Source]]], data: DataConfig, tokenizer: Tokenizer) -> None:
    """Global rank 0 tokenizes the raw datasets (others wait in one broadcast, under the start-up timeout)."""
    raw = [plan for plan in plans if plan[2]]
    if not raw:
        return
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    error = None
    if not distributed or dist.get_rank() == 0:
        try:
            for what, cache, sources in raw:
                _tokenize_one(what, cache, sources, data, tokenizer)
        except Exception as e:
            if not distributed:
                raise
            error = e
    if distributed:  # the barrier; it also tells every rank why rank 0 failed
        message = [f"{type(error).__name__}: {error}" if error else None]
        dist.broadcast_object_list(message, src=0)
        if error:
            raise error
        if message[0]:
            raise DataError(f"rank 0 failed to tokenize {raw[0][0]}: {message[0]}")
        for what, cache, _ in raw:
            if not (cache / META).is_file():
                raise DataError(
                    f"data.cache_dir: the tokens of {what} that rank 0 wrote in '{cache}' are not visible here; put "
                    "data.cache_dir on a filesystem that all nodes share"
                )


def _tokenize_one(what: str, cache: Path, sources: list[Source], data: DataConfig, tokenizer: Tokenizer) -> None:
    megabytes = sum(source.bytes for source in sources) / 1e6
    workers = data.tokenize_workers or max(1, min(available_cpus(), math.ceil(megabytes / AUTO_MB_PER_WORKER)))
    started = time.perf_counter()
    labels = Labels(source=what, text_column="data.text_column", out="data.cache_dir")
    meta, status = tokenize(
        sources,
        tokenizer,
        cache,
        workers=workers,
        text_column=data.text_column,
        validation_split=data.validation_split,
        labels=labels,
    )
    if status != "reused":
        seconds = time.perf_counter() - started
        print(
            f"data: tokenized {what} with {workers} workers in {seconds:.1f}s: {summary(meta)} in {cache}", flush=True
        )
