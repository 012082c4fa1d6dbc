"""Data pipeline: tokenizer, cached corpus, validation split, dp-independent sample order, exact resume."""

from __future__ import annotations

import json
import multiprocessing
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nanotron.config import DataConfig, TrainingConfig
from nanotron.data import (
    StepSampler,
    build_train_loader,
    eval_batches,
    load_corpus,
)
from nanotron.errors import DataError
from nanotron.prepare import EOS_TOKEN, train_tokenizer
from nanotron.tokenizer import load_tokenizer

SEQ_LEN = 16
NUM_DOCS = 40
WORDS = ["thou", "art", "the", "king", "of", "all", "my", "love", "and", "hate", "fair", "foul", "night", "day"]
WORDS += ["sword", "crown", "heaven", "earth", "sweet", "prince", "good", "lord", "madam", "speak", "hear", "tis"]


def make_documents(num_docs: int, seed: int = 0) -> list[str]:
    """Each document starts with a unique header, so a decoded chunk tells which document it was."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        paragraphs = [" ".join(rng.choices(WORDS, k=rng.randint(6, 16))) for _ in range(rng.randint(3, 7))]
        docs.append(f"DOCUMENT {i}.\n\n" + "\n\n".join(paragraphs) + "\n")
    return docs


def write_jsonl(path: Path, docs: list[str], column: str = "text") -> Path:
    path.write_text("".join(json.dumps({column: d}) + "\n" for d in docs))
    return path


def training(mbs: int = 2, accum: int = 4, dp: int = 1, eval_steps: int = 2, eval_interval: int = 10):
    return TrainingConfig(
        micro_batch_size=mbs,
        grad_accum_steps=accum,
        global_batch_size=mbs * accum * dp,
        seq_len=SEQ_LEN,
        eval_steps=eval_steps,
        eval_interval=eval_interval,
    )


def documents_of(tokens: np.ndarray, tok) -> list[str]:
    """The decoded documents of a token stream (each one ends with EOS)."""
    ends = np.flatnonzero(np.asarray(tokens) == tok.eos_id)
    assert len(ends) and ends[-1] == len(tokens) - 1, "the stream must end with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends)]


def take(loader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


@pytest.fixture(scope="session", autouse=True)
def offline_hub(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    docs = make_documents(NUM_DOCS)
    write_jsonl(root / "corpus.jsonl", docs)
    train_tokenizer(docs, root / "tokenizer", vocab_size=300)
    return root


def data_config(root: Path, **overrides) -> DataConfig:
    options = {"path": str(root / "corpus.jsonl"), "tokenizer": str(root / "tokenizer"), "validation_split": 0.1}
    return DataConfig(**{**options, "cache_dir": str(root / "cache"), **overrides})


@pytest.fixture(scope="module")
def tok(workspace):
    return load_tokenizer(str(workspace / "tokenizer"))


@pytest.fixture(scope="module")
def corpus(workspace, tok):
    return load_corpus(data_config(workspace), tok, seq_len=SEQ_LEN, seed=0)


def test_tokenizer_round_trips_and_knows_its_eos(tok, workspace):
    text = "Thou art café — naïve ☃\n\n  twice  spaced\tTAB\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 300
    assert tok.eos_id == tok.backend.token_to_id(EOS_TOKEN) and tok.eos_id not in ids
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(workspace / "tokenizer"))
    assert (hf.eos_token, hf.eos_token_id, len(hf)) == (EOS_TOKEN, tok.eos_id, tok.vocab_size)
    assert hf.encode(text, add_special_tokens=False) == ids


def test_corpus_is_every_document_followed_by_eos(workspace, tok):
    corpus = load_corpus(data_config(workspace, validation_split=0.0), tok, seq_len=SEQ_LEN, seed=0)
    assert documents_of(corpus.train, tok) == make_documents(NUM_DOCS)
    assert len(corpus.val) == 0 and corpus.num_val_samples == 0
    assert corpus.train.dtype == np.uint16
    assert corpus.num_train_samples == (len(corpus.train) - 1) // SEQ_LEN


def test_validation_documents_never_appear_in_train(workspace, tok, corpus):
    train_docs, val_docs = documents_of(corpus.train, tok), documents_of(corpus.val, tok)
    assert len(val_docs) == round(0.1 * NUM_DOCS)
    assert set(train_docs).isdisjoint(val_docs)
    assert sorted(train_docs + val_docs) == sorted(make_documents(NUM_DOCS))
    other_seed = load_corpus(data_config(workspace), tok, seq_len=SEQ_LEN, seed=1)
    assert set(documents_of(other_seed.val, tok)) != set(val_docs)


def test_single_document_holds_out_the_tail_of_its_tokens(tmp_path, tok, workspace):
    doc = make_documents(1)[0] * 20
    data = data_config(workspace, path=str(write_jsonl(tmp_path / "one.jsonl", [doc])), validation_split=0.25)
    data.cache_dir = str(tmp_path / "cache")
    corpus = load_corpus(data, tok, seq_len=SEQ_LEN, seed=0)
    whole = tok.encode(doc) + [tok.eos_id]
    assert len(corpus.val) == round(0.25 * len(whole))
    assert np.concatenate([corpus.train, corpus.val]).tolist() == whole


def test_text_folder_is_one_document_per_file(tmp_path, tok, workspace):
    docs = make_documents(3)
    for i, doc in enumerate(docs):
        (tmp_path / f"play{i}.txt").write_text(doc)
    data = data_config(workspace, path=str(tmp_path), validation_split=0.0, cache_dir=str(tmp_path / ".cache"))
    assert documents_of(load_corpus(data, tok, seq_len=SEQ_LEN, seed=0).train, tok) == docs


def test_microbatches_are_packed_samples_and_an_epoch_visits_each_once(corpus):
    train = training(mbs=2, accum=4)
    sampler = StepSampler(corpus.num_train_samples, train, seed=0, dp=1, dp_rank=0)
    n = corpus.num_train_samples
    for g, row in enumerate(torch.cat(take(build_train_loader(corpus, train, seed=0, dp=1, dp_rank=0), 6))):
        i = sampler.sample(g)
        assert row.dtype == torch.int64 and row.tolist() == corpus.train[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1].tolist()
    first_epoch = [sampler.sample(g) for g in range(n)]
    assert sorted(first_epoch) == list(range(n))
    assert [sampler.sample(g) for g in range(n, 2 * n)] != first_epoch


@pytest.mark.parametrize("dp", [2, 4])
def test_step_samples_do_not_depend_on_dp(corpus, dp):
    global_batch, steps = 8, corpus.num_train_samples // 8 + 2  # crosses an epoch boundary
    reference = torch.cat(take(build_train_loader(corpus, training(2, 4, 1), seed=3, dp=1, dp_rank=0), steps * 4))
    accum = global_batch // (2 * dp)
    per_rank = [
        take(build_train_loader(corpus, training(2, accum, dp), seed=3, dp=dp, dp_rank=r), steps * accum)
        for r in range(dp)
    ]
    for step in range(steps):
        expected = reference[step * global_batch : (step + 1) * global_batch]
        got = torch.cat([mb for rank in per_rank for mb in rank[step * accum : (step + 1) * accum]])
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, expected.tolist()))
        # microbatch m of rank d holds global samples step*G + m*mbs*dp + d*mbs + [0, mbs)
        by_micro_then_rank = [rank[step * accum + m] for m in range(accum) for rank in per_rank]
        assert torch.equal(torch.cat(by_micro_then_rank), expected)


def test_order_is_a_pure_function_of_the_seed(corpus):
    def first(seed):
        return torch.stack(take(build_train_loader(corpus, training(), seed=seed, dp=1, dp_rank=0), 20))

    assert torch.equal(first(5), first(5))
    assert not torch.equal(first(5), first(6))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["mid_epoch", "after_epoch_boundary"])
def test_resume_at_a_step_continues_exactly(corpus, num_workers, where):
    """The data position is the global sample count: a loader started there yields what the first would have."""
    train = training(mbs=2, accum=4)
    steps_per_epoch = corpus.num_train_samples // train.global_batch_size
    steps = steps_per_epoch - 1 if where == "mid_epoch" else steps_per_epoch + 1
    reference = take(build_train_loader(corpus, train, seed=7, dp=1, dp_rank=0), (steps + 3) * 4)
    start = steps * train.global_batch_size
    resumed = build_train_loader(corpus, train, seed=7, dp=1, dp_rank=0, num_workers=num_workers, start_sample=start)
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 12), reference[steps * 4 :], strict=True))


def test_eval_batches_are_fixed_and_split_over_dp(corpus):
    dp1 = list(eval_batches(corpus, training(2, 4, 1), dp=1, dp_rank=0))
    assert len(dp1) == 2 * 4 and all(mb.shape == (2, SEQ_LEN + 1) for mb in dp1)
    assert all(torch.equal(a, b) for a, b in zip(dp1, eval_batches(corpus, training(2, 4, 1), dp=1, dp_rank=0)))
    assert dp1[0][1].tolist() == corpus.val[SEQ_LEN : 2 * SEQ_LEN + 1].tolist()  # in order, no shuffle
    ranks = [list(eval_batches(corpus, training(2, 2, 2), dp=2, dp_rank=r)) for r in range(2)]
    interleaved = [mb for step in range(2 * 2) for rank in ranks for mb in rank[step : step + 1]]
    assert torch.equal(torch.cat(interleaved), torch.cat(dp1))


def test_cache_is_reused_then_rebuilt_when_the_tokenizer_changes(tmp_path, workspace):
    data = data_config(workspace, cache_dir=str(tmp_path / "cache"), tokenizer=str(tmp_path / "tokenizer"))
    train_tokenizer(make_documents(NUM_DOCS), tmp_path / "tokenizer", vocab_size=300)
    first = load_corpus(data, load_tokenizer(data.tokenizer), seq_len=SEQ_LEN, seed=0)
    [cache] = (tmp_path / "cache").iterdir()
    stamp = (cache / "train.bin").stat().st_mtime_ns
    again = load_corpus(data, load_tokenizer(data.tokenizer), seq_len=SEQ_LEN, seed=0)
    assert (cache / "train.bin").stat().st_mtime_ns == stamp and np.array_equal(first.train, again.train)
    train_tokenizer(make_documents(NUM_DOCS), tmp_path / "tokenizer", vocab_size=280)
    rebuilt = load_corpus(data, load_tokenizer(data.tokenizer), seq_len=SEQ_LEN, seed=0)
    assert len(list((tmp_path / "cache").iterdir())) == 2
    assert len(rebuilt.train) > len(first.train)  # fewer merges, more tokens


def _rank_main(rank: int, root: str, data: DataConfig, init_file: str) -> None:
    import nanotron.data as data_module

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    build = data_module._build_cache

    def record_build(*args, **kwargs):
        Path(root, f"built-by-{rank}").touch()
        return build(*args, **kwargs)

    data_module._build_cache = record_build
    try:
        corpus = load_corpus(data, load_tokenizer(data.tokenizer), seq_len=SEQ_LEN, seed=0)
        Path(root, f"tokens-{rank}").write_text(str(corpus.train.tolist()))
    except DataError as e:
        Path(root, f"error-{rank}").write_text(str(e))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_only_rank_zero_builds_and_its_errors_reach_every_rank(tmp_path, workspace, broken):
    data = data_config(workspace, cache_dir=str(tmp_path / "cache"), text_column="body" if broken else "text")
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_rank_main, args=(r, str(tmp_path), data, str(tmp_path / "init"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(f.name for f in tmp_path.glob("built-by-*")) == ["built-by-0"]
    if broken:
        assert "data.text_column" in (tmp_path / "error-0").read_text()
        assert "rank 0" in (tmp_path / "error-1").read_text() and "'body'" in (tmp_path / "error-1").read_text()
    else:
        assert (tmp_path / "tokens-0").read_text() == (tmp_path / "tokens-1").read_text()


def test_missing_path_names_the_key_and_the_demo_corpus_script(tmp_path, tok, workspace):
    missing = tmp_path / "no" / "corpus"
    with pytest.raises(DataError, match="data.path") as info:
        load_corpus(data_config(workspace, path=str(missing)), tok, seq_len=SEQ_LEN, seed=0)
    assert str(missing) in str(info.value) and "scripts/prepare_data.sh" in str(info.value)


def test_hub_name_fails_fast_when_offline(tok, workspace, monkeypatch):
    start = time.perf_counter()
    with pytest.raises(DataError, match="offline .*HF_HUB_OFFLINE.*local path"):
        load_corpus(data_config(workspace, path="someorg/some-dataset"), tok, seq_len=SEQ_LEN, seed=0)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1")  # nothing listens on 443: the probe fails
    with pytest.raises(DataError, match="127.0.0.1:443 is unreachable"):
        load_corpus(data_config(workspace, path="someorg/some-dataset"), tok, seq_len=SEQ_LEN, seed=0)
    assert time.perf_counter() - start < 5


def test_missing_text_column_lists_the_columns(tmp_path, tok, workspace):
    path = write_jsonl(tmp_path / "c.jsonl", make_documents(3), column="content")
    with pytest.raises(DataError, match=r"data.text_column: 'text'.*\['content'\]"):
        load_corpus(data_config(workspace, path=str(path), cache_dir=str(tmp_path)), tok, seq_len=SEQ_LEN, seed=0)


def test_missing_tokenizer_names_the_key(tmp_path):
    with pytest.raises(DataError, match="data.tokenizer") as info:
        load_tokenizer(str(tmp_path / "absent"))
    assert str(tmp_path / "absent") in str(info.value)


def test_too_little_data_for_a_global_batch_or_for_eval_is_an_error(corpus):
    with pytest.raises(DataError, match="fewer than one global batch"):
        build_train_loader(corpus, training(mbs=corpus.num_train_samples, accum=2), seed=0, dp=1, dp_rank=0)
    too_many = corpus.num_val_samples // 8 + 1
    with pytest.raises(DataError, match="lower training.eval_steps"):
        build_train_loader(corpus, training(eval_steps=too_many), seed=0, dp=1, dp_rank=0)
    with pytest.raises(DataError, match=f"needs training.eval_steps \\* global_batch_size = {too_many} \\* 8"):
        eval_batches(corpus, training(eval_steps=too_many), dp=1, dp_rank=0)
    no_eval = build_train_loader(corpus, training(eval_steps=too_many, eval_interval=0), seed=0, dp=1, dp_rank=0)
    assert next(iter(no_eval)).shape == (2, SEQ_LEN + 1)
