"""Samples → dp-sharded microbatches.

Global sample g is a pure function of (seed, g): the blend picks its dataset and its index j there, j's epoch
picks a keyed permutation of that dataset's samples, and the sample is read from the memory map. So a step takes
the same global samples at every dp/tp/pp, and a resume at any layout continues at consumed_samples. Per sample
this costs O(log datasets) integer work, a Feistel permutation (microseconds) and one (seq_len+1)-token read.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from nanotron.config import TrainingConfig
from nanotron.data.corpus import Corpus, check_validation
from nanotron.data.order import Permutation, key_of
from nanotron.data.skips import SampleSkips
from nanotron.errors import DataError
from nanotron.signals import ignore_stop_signals


class TrainSamples(Dataset):
    """Item g is global training sample g: LongTensor [seq_len + 1], inputs plus the shifted targets."""

    def __init__(self, corpus: Corpus, seed: int) -> None:
        self.corpus, self.seed = corpus, seed
        self.sizes = [d.train.num_samples(corpus.seq_len) for d in corpus.datasets]
        self._permutations: dict[int, tuple[int, Permutation]] = {}  # per dataset: its current epoch's

    def locate(self, g: int) -> tuple[int, int]:
        """(dataset, sample index in its train split) of global sample g."""
        dataset, j = self.corpus.blend.locate(g)
        epoch, position = divmod(j, self.sizes[dataset])
        current = self._permutations.get(dataset)
        if current is None or current[0] != epoch:
            current = (epoch, Permutation(self.sizes[dataset], key_of(self.seed, dataset, epoch)))
            self._permutations[dataset] = current
        return dataset, current[1](position)

    def __getitem__(self, g: int) -> torch.Tensor:
        dataset, index = self.locate(g)
        seq_len = self.corpus.seq_len
        tokens = self.corpus.datasets[dataset].train.read(
            index * seq_len, seq_len + 1, self.corpus.vocab_size, f"global sample {g}"
        )
        return torch.from_numpy(tokens)


def _microbatch_start(index: int, training: TrainingConfig, dp: int, dp_rank: int) -> int:
    """First global sample of this rank's `index`-th microbatch (counted from a step boundary): step, then
    microbatch, then dp rank."""
    step, micro = divmod(index, training.grad_accum_steps)
    mbs = training.micro_batch_size
    return step * mbs * training.grad_accum_steps * dp + micro * mbs * dp + dp_rank * mbs


class StepSampler(Sampler[list[int]]):
    """This dp rank's microbatches of global sample indices, forever, from the `start`-th trained sample on: where
    a run resumes needs no state beyond its trained sample count (and the skipped windows, which move the k-th
    trained sample to the k-th position outside them)."""

    def __init__(
        self, training: TrainingConfig, dp: int, dp_rank: int, start: int = 0, skips: SampleSkips | None = None
    ) -> None:
        self.training, self.dp, self.dp_rank, self.start = training, dp, dp_rank, start
        self.skips = skips or SampleSkips()

    def __iter__(self) -> Iterator[list[int]]:
        index, mbs = 0, self.training.micro_batch_size
        while True:
            first = self.start + _microbatch_start(index, self.training, self.dp, self.dp_rank)
            yield [self.skips.position(k) for k in range(first, first + mbs)]
            index += 1


def build_train_loader(
    corpus: Corpus,
    training: TrainingConfig,
    seed: int,
    dp: int,
    dp_rank: int,
    num_workers: int | None = None,
    start_sample: int = 0,
    skips: SampleSkips | None = None,
) -> DataLoader:
    """LongTensor [micro_batch_size, seq_len+1] microbatches forever, from the `start_sample`-th trained sample on,
    of a corpus `open_corpus` checked against this global batch.

    Building it reads nothing and allocates nothing that grows with the corpus: start-up and resume are O(1).
    """
    if training.global_batch_size != training.micro_batch_size * training.grad_accum_steps * dp:
        raise ValueError("training.global_batch_size must equal micro_batch_size * grad_accum_steps * dp")
    sampler = StepSampler(training, dp, dp_rank, start_sample, skips)
    workers = corpus.num_workers if num_workers is None else num_workers
    samples = TrainSamples(corpus, seed)
    return DataLoader(samples, batch_sampler=sampler, num_workers=workers, worker_init_fn=ignore_stop_signals)


def eval_batches(corpus: Corpus, training: TrainingConfig, dp: int, dp_rank: int) -> Iterator[torch.Tensor]:
    """The same validation microbatches every call: the first eval_steps global batches of the blended
    validation samples, each dataset's in order (no shuffle)."""
    check_validation(corpus, training)
    seq_len = corpus.seq_len

    def sample(g: int) -> torch.Tensor:
        dataset, j = corpus.blend.locate(g)
        tokens = corpus.datasets[dataset].val.read(
            j * seq_len, seq_len + 1, corpus.vocab_size, f"validation sample {g}"
        )
        return torch.from_numpy(tokens)

    starts = (
        _microbatch_start(i, training, dp, dp_rank) for i in range(training.eval_steps * training.grad_accum_steps)
    )
    return (torch.stack([sample(g) for g in range(s, s + training.micro_batch_size)]) for s in starts)


def loader_batches(loader: DataLoader) -> Iterator[torch.Tensor]:
    """The loader's batches; a DataError met in a worker process comes back as the same one line (torch re-raises
    it with the worker's traceback folded into the message)."""
    iterator = iter(loader)
    while True:
        try:
            batch = next(iterator)
        except DataError as error:
            lines = [line for line in str(error).splitlines() if line.strip()]
            message = lines[-1].split("DataError: ", 1)[-1]  # after "Caught DataError in DataLoader worker ..."
            # The traceback's frames hold the iterator (and the error itself: a cycle only a garbage collection
            # would free); cleared, the `del` below is its last reference.
            traceback.clear_frames(error.__traceback__)
            break
        yield batch
    # Dropped before raising, so its worker processes are told to exit now: they ignore stop signals (the
    # trainer's own shutdown does), so a process that is not ending through os._exit would wait for them.
    del iterator
    raise DataError(message)
