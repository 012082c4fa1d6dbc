"""Documents → token ids with `tokenizers`, in this process or in a pool of worker processes.

Each worker runs `encode_batch` on one core (TOKENIZERS_PARALLELISM off): N workers use N cores, and the
batches come back in the order they went out, so the output never depends on the number of workers.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import re
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import tokenizers

from nanotron.signals import STOP_SIGNALS, die_with_parent, ignore_stop_signals
from nanotron.tokenize.tokenizer import Tokenizer

BATCH_CHARS = 1 << 18  # text per task: pickling stays a small share of the work, and the workers stay balanced
# A paragraph break after a non-space character: GPT-2-style byte-level BPE always ends a pre-token there, so
# encoding the pieces gives the whole document's ids, faster than one long string.
_PARAGRAPH = re.compile(r"(?<=\S)(?=\n\n)")
_PROBE = "Thou art.\n\nNext line,\n\n\n  indented\n\n\tTab 42\n\n'Quoted' text\n\n— dash, café\n\nend\n\n"


class Encoder:
    """Documents → (flat tokens: each non-empty document then EOS, per-document lengths)."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str) -> None:
        self.backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.eos_id, self.dtype = eos_id, np.dtype(dtype)
        self.split = self._split_is_exact()

    def _split_is_exact(self) -> bool:
        """Paragraph pieces only where they give the same ids as whole documents (checked on a probe text)."""
        whole = self.backend.encode(_PROBE, add_special_tokens=False).ids
        pieces = self.backend.encode_batch(_PARAGRAPH.split(_PROBE), add_special_tokens=False)
        return whole == [i for piece in pieces for i in piece.ids]

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        pieces = [_PARAGRAPH.split(text) if self.split else [text] for text in texts]
        encodings = iter(self.backend.encode_batch([p for doc in pieces for p in doc], add_special_tokens=False))
        ids, lengths, eos = [], np.zeros(len(texts), np.int64), [self.eos_id]
        for index, doc in enumerate(pieces):
            length = 0
            for _ in doc:
                piece = next(encodings).ids
                ids.append(piece)
                length += len(piece)
            if length:  # an empty document adds nothing, not even EOS
                ids.append(eos)
                lengths[index] = length + 1
        return np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum())), lengths


def available_cpus() -> int:
    """The CPUs this process may run on (a Slurm or container limit included), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def batches(documents: Iterable[str], chars: int | None = None) -> Iterator[list[str]]:
    """Consecutive documents grouped until they hold `chars` (default BATCH_CHARS) characters."""
    batch, size, chars = [], 0, chars or BATCH_CHARS
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_batches(
    texts: Iterable[list[str]], tokenizer: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each batch's (tokens, lengths), in input order. One worker encodes here; more use a process pool with
    2 batches in flight per worker, so memory stays bounded whatever the corpus size."""
    encoder_args = (tokenizer.backend.to_str(), tokenizer.eos_id, np.dtype(dtype).str)
    with _single_threaded():
        if workers <= 1:
            encoder = Encoder(*encoder_args)
            yield from map(encoder, texts)
            return
        # spawn: nothing of this process (threads, a process group) is inherited by the workers
        context = multiprocessing.get_context("spawn")
        initargs = (os.getpid(), *encoder_args)
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=initargs) as pool:
            pending: deque = deque()
            try:
                for batch in texts:
                    # the first submits start the workers: they inherit stop signals blocked, then ignore them
                    with _stop_signals_blocked() if len(pending) < workers else contextlib.nullcontext():
                        pending.append(pool.submit(_encode_in_worker, batch))
                    if len(pending) >= 2 * workers:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """`tokenizers` reads TOKENIZERS_PARALLELISM at every call: off, one encoder uses exactly one core."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited by spawned workers too
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


_WORKER_ENCODER: Encoder | None = None


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """Ctrl-C or SIGTERM while a worker starts would otherwise end it mid-import with a traceback."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _init_worker(parent: int, tokenizer_json: str, eos_id: int, dtype: str) -> None:
    """Stop signals are the parent's to handle (it keeps the committed shards and exits; the worker then dies)."""
    global _WORKER_ENCODER
    ignore_stop_signals()  # SIGUSR1 too: the tokenizing process alone decides what a stop signal means
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with(parent)
    _WORKER_ENCODER = Encoder(tokenizer_json, eos_id, dtype)


def _die_with(parent: int) -> None:
    """A worker ends when the tokenizing process does, even when that one was SIGKILLed (Linux: the kernel's
    parent-death signal); otherwise it would wait forever for work."""
    if not die_with_parent(signal.SIGKILL):  # not Linux: workers then end when they find their queue closed
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _WORKER_ENCODER(texts)
