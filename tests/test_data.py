"""Data pipeline: tokenized dirs read by memmap, validation split, keyed shuffle, blend, dp-independent step
samples, exact resume, fixed eval batches, and one-line errors for damaged or oversized data."""

from __future__ import annotations

import gc
import json
import multiprocessing
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nanotron.config import TrainingConfig, load_config
from nanotron.data import check_corpus_size, open_corpus
from nanotron.data.loader import TrainSamples, build_train_loader, eval_batches, loader_batches
from nanotron.data.order import Blend, Permutation, key_of
from nanotron.errors import DataError
from nanotron.parallel.init import name_seed
from nanotron.tokenize.bpe import EOS_TOKEN, train_tokenizer
from nanotron.tokenize.encode import Encoder
from nanotron.tokenize.sources import resolve_sources
from nanotron.tokenize.tokenizer import load_tokenizer
from nanotron.tokenize.writer import tokenize

SEQ_LEN = 16
NUM_DOCS = 40
WORDS = ["thou", "art", "the", "king", "of", "all", "my", "love", "and", "hate", "fair", "foul", "night", "day"]
WORDS += ["sword", "crown", "heaven", "earth", "sweet", "prince", "good", "lord", "madam", "speak", "hear", "tis"]


def make_documents(num_docs: int, seed: int = 0, title: str = "DOCUMENT") -> list[str]:
    """Each document starts with a unique header, so a decoded chunk tells which document it was. Some paragraphs
    are indented, as verse is: the tokenizer then learns a token for a blank line, which a careless split at
    paragraph breaks would produce where the whole document has none."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        paragraphs = [
            rng.choice(["", "  "]) + " ".join(rng.choices(WORDS, k=rng.randint(6, 16)))
            for _ in range(rng.randint(3, 7))
        ]
        docs.append(f"{title} {i}.\n\n" + "\n\n".join(paragraphs) + "\n")
    return docs


def write_jsonl(path: Path, docs: list[str], column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
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


def whole(stream) -> np.ndarray:
    return stream.read(0, stream.total) if stream.total else np.zeros(0, np.int64)


def take(loader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    docs = make_documents(NUM_DOCS)
    write_jsonl(root / "corpus.jsonl", docs)
    write_jsonl(root / "other.jsonl", make_documents(NUM_DOCS // 2, seed=9, title="OTHER"))
    train_tokenizer(docs, root / "tokenizer", vocab_size=300)
    return root


@pytest.fixture(scope="module")
def tok(workspace):
    return load_tokenizer(str(workspace / "tokenizer"))


def tokenized(workspace: Path, tok, name: str = "corpus.jsonl", **options) -> Path:
    """A tokenized dir of a corpus file, with small shards (samples cross shard boundaries)."""
    options = {"validation_split": 0.1, "shard_tokens": 700, "progress": False, **options}
    out = workspace / "tokenized" / f"{name}-{'-'.join(f'{k}{v}' for k, v in sorted(options.items()))}"
    tokenize(resolve_sources([str(workspace / name)]), tok, out, **options)
    return out


def config(workspace: Path, path: Path | str, *overrides: str, **data):
    pairs = [("data.path", str(path)), ("data.tokenizer", str(workspace / "tokenizer")), ("model.vocab_size", "300")]
    pairs += [("training.seq_len", str(SEQ_LEN)), ("training.micro_batch_size", "2"), ("training.eval_steps", "2")]
    pairs += [("training.global_batch_size", "8"), ("training.grad_accum_steps", "0")]
    pairs += [(f"data.{k}", str(v)) for k, v in data.items()]
    return load_config(None, pairs + [tuple(o.split("=", 1)) for o in overrides])


@pytest.fixture(scope="module")
def corpus(workspace, tok):
    return open_corpus(config(workspace, tokenized(workspace, tok)))


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


def test_every_document_is_encoded_whole_then_eos_across_shards(workspace, tok):
    directory = tokenized(workspace, tok, validation_split=0.0)
    corpus = open_corpus(config(workspace, directory, "training.eval_interval=0"))
    train = corpus.datasets[0].train
    assert len(train.files) > 3 and train.dtype == np.uint16
    tokens = whole(train)
    assert documents_of(tokens, tok) == make_documents(NUM_DOCS)
    # the paragraph pieces the tokenizer sees (the fast path, on for byte-level BPE) encode as whole documents do
    assert Encoder(tok.backend.to_str(), tok.eos_id, "<u2").split
    expected = [i for doc in make_documents(NUM_DOCS) for i in [*tok.encode(doc), tok.eos_id]]
    assert tokens.tolist() == expected
    assert corpus.num_train_samples == (len(tokens) - 1) // SEQ_LEN and corpus.num_val_samples == 0


def test_validation_documents_never_appear_in_train(workspace, tok, corpus):
    dataset = corpus.datasets[0]
    train_docs, val_docs = documents_of(whole(dataset.train), tok), documents_of(whole(dataset.val), tok)
    assert len(val_docs) == round(0.1 * NUM_DOCS)  # exactly the fraction: one per stratum of 10 documents
    assert set(train_docs).isdisjoint(val_docs)
    assert sorted(train_docs + val_docs) == sorted(make_documents(NUM_DOCS))
    other_seed = open_corpus(config(workspace, tokenized(workspace, tok, seed=1))).datasets[0]
    assert set(documents_of(whole(other_seed.val), tok)) != set(val_docs)


def test_text_folder_is_one_document_per_file(tmp_path, tok, workspace):
    docs = make_documents(3)
    for i, doc in enumerate(docs):
        (tmp_path / f"play{i}.txt").write_text(doc)
    tokenize(resolve_sources([str(tmp_path)]), tok, tmp_path / "out", validation_split=0.0, progress=False)
    corpus = open_corpus(config(workspace, tmp_path / "out", "training.eval_interval=0", "training.seq_len=4"))
    assert documents_of(whole(corpus.datasets[0].train), tok) == docs


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_the_keyed_shuffle_is_a_permutation_and_depends_on_the_key(n):
    orders = [[Permutation(n, key)(i) for i in range(n)] for key in (0, 1, 2)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    if n >= 16:  # (a handful of samples has few orders to choose from)
        assert orders[0] != orders[1] != orders[2] and list(range(n)) not in orders
    with pytest.raises(IndexError):
        Permutation(n, 0)(n)


def test_init_seeds_and_data_order_keys_are_the_same_integers_as_ever():
    """One stable hash seeds each parameter's init and keys the sample order: these values fix every run's weights
    and data, so they must never change (recorded before the two copies of the hash were merged)."""
    assert name_seed(42, "model.embed_tokens.weight") == 8760530646438631872
    assert name_seed(0, "lm_head.weight") == 3528297259338047458
    assert (key_of(42, 0, 0), key_of(7, 3, 1)) == (4966074703835417981, 1713689448289929515)
    assert [Permutation(10, key_of(42, 0, 0))(i) for i in range(10)] == [3, 2, 4, 7, 0, 1, 5, 6, 9, 8]


def test_microbatches_are_packed_samples_and_an_epoch_visits_each_once(corpus):
    train = training(mbs=2, accum=4)
    samples, stream = TrainSamples(corpus, seed=0), corpus.datasets[0].train
    n = corpus.num_train_samples
    for g, row in enumerate(torch.cat(take(build_train_loader(corpus, train, seed=0, dp=1, dp_rank=0), 6))):
        _, i = samples.locate(g)
        assert row.dtype == torch.int64 and row.tolist() == whole(stream)[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1].tolist()
    first_epoch = [samples.locate(g)[1] for g in range(n)]
    assert sorted(first_epoch) == list(range(n))
    assert [samples.locate(g)[1] for g in range(n, 2 * n)] != first_epoch


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
    val = whole(corpus.datasets[0].val)
    assert dp1[0][1].tolist() == val[SEQ_LEN : 2 * SEQ_LEN + 1].tolist()  # in order, no shuffle
    ranks = [list(eval_batches(corpus, training(2, 2, 2), dp=2, dp_rank=r)) for r in range(2)]
    interleaved = [mb for step in range(2 * 2) for rank in ranks for mb in rank[step : step + 1]]
    assert torch.equal(torch.cat(interleaved), torch.cat(dp1))


@pytest.mark.parametrize("weights", [[1.0], [0.5, 0.5], [0.7, 0.2, 0.1], [3, 1, 1, 1, 2], [0.01, 0.99]])
def test_the_blend_gives_each_dataset_its_weight_and_consecutive_indices(weights):
    blend, n = Blend(weights), 10_000
    located = [blend.locate(g) for g in range(n)]
    counts = [sum(1 for d, _ in located if d == dataset) for dataset in range(len(weights))]
    assert counts == blend.counts(n)
    for dataset, count in enumerate(counts):
        assert abs(count - n * weights[dataset] / sum(weights)) <= 2  # within log2(datasets) samples, far under 1%
        assert [j for d, j in located if d == dataset] == list(range(count))  # each dataset read in its own order


def test_a_blended_corpus_draws_each_dataset_by_weight_and_shuffles_each_alone(workspace, tok, tmp_path):
    first, second = tokenized(workspace, tok), tokenized(workspace, tok, "other.jsonl")
    cfg = config(workspace, "", f"data.datasets={first}:3,{second}:1")
    corpus = open_corpus(cfg)
    samples = TrainSamples(corpus, seed=0)
    sizes = [d.train.num_samples(SEQ_LEN) for d in corpus.datasets]
    total = 8 * sizes[1] + 8  # two epochs and more of the small dataset, a quarter of the samples
    rows = take(build_train_loader(corpus, cfg.training, seed=0, dp=1, dp_rank=0), total // 2)
    streams, seen = [whole(d.train) for d in corpus.datasets], [[], []]
    for g, row in enumerate(torch.cat(rows)):
        dataset, index = samples.locate(g)
        seen[dataset].append(index)
        assert row.tolist() == streams[dataset][index * SEQ_LEN : (index + 1) * SEQ_LEN + 1].tolist()
    assert [len(s) for s in seen] == [total * 3 // 4, total // 4]
    assert sorted(seen[1][: sizes[1]]) == list(range(sizes[1]))  # the small dataset's epochs: every sample once
    assert sorted(seen[1][sizes[1] : 2 * sizes[1]]) == list(range(sizes[1])) != seen[1][sizes[1] : 2 * sizes[1]]


def test_a_cut_missing_or_odd_shard_is_one_error_naming_the_file(workspace, tok, tmp_path):
    directory = tokenized(workspace, tok, seed=5)
    shard = directory / "train-00001.bin"
    good = shard.read_bytes()
    for damage in ("half", "odd", "missing"):
        if damage == "missing":
            shard.unlink()
        else:
            shard.write_bytes(good[: len(good) // 4 * 2] if damage == "half" else good + b"\0")
        with pytest.raises(DataError) as info:
            open_corpus(config(workspace, directory))
        message = str(info.value)
        assert message.startswith(f"data.path: token file '{shard}'") and "re-run `nanotron tokenize`" in message
        assert ("not a whole number of 2-byte tokens" in message) == (damage == "odd")
        shard.write_bytes(good)
    assert open_corpus(config(workspace, directory)).num_train_samples > 0


def test_a_tokenized_dir_of_another_tokenizer_is_refused(workspace, tok, tmp_path):
    train_tokenizer(make_documents(NUM_DOCS), tmp_path / "tokenizer", vocab_size=280)
    with pytest.raises(DataError, match="was tokenized with another tokenizer"):
        open_corpus(config(workspace, tokenized(workspace, tok), f"data.tokenizer={tmp_path / 'tokenizer'}"))


@pytest.mark.parametrize("path", ["corpus.jsonl", "folder", "someorg/some-dataset"])
def test_a_raw_corpus_or_a_hub_name_is_one_line_with_the_tokenize_command(workspace, capsys, path):
    """Training reads tokenized dirs only: anything else is refused before a model is built, with the exact
    `nanotron tokenize` command that makes one."""
    from nanotron.train import main

    (workspace / "folder").mkdir(exist_ok=True)
    spec = path if "/" in path else str(workspace / path)
    common = ["--data.tokenizer", str(workspace / "tokenizer"), "--model.vocab_size=300", "--training.seq_len=16"]
    assert main([f"--data.path={spec}", *common]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: data.path: '{spec}' is not a tokenized dir; tokenize it before training: `nanotron tokenize {spec} "
        f"--tokenizer {workspace / 'tokenizer'} --out DIR`, then set data.path=DIR"
    ]


def test_missing_path_names_the_key_and_the_demo_corpus_script(tmp_path, workspace):
    missing = tmp_path / "no" / "corpus"
    with pytest.raises(DataError, match="data.path") as info:
        open_corpus(config(workspace, missing))
    assert str(missing) in str(info.value) and "scripts/prepare_data.sh" in str(info.value)


def test_an_unfinished_tokenized_dir_says_to_rerun_the_command(workspace, tok, tmp_path):
    directory = tokenized(workspace, tok, seed=7)
    (directory / "meta.json").rename(directory / "progress.json")
    with pytest.raises(DataError, match="unfinished `nanotron tokenize` output .* re-run the same"):
        open_corpus(config(workspace, directory))


def test_missing_tokenizer_names_the_key(tmp_path):
    with pytest.raises(DataError, match="data.tokenizer") as info:
        load_tokenizer(str(tmp_path / "absent"))
    assert str(tmp_path / "absent") in str(info.value)


def test_too_little_data_for_a_global_batch_or_for_eval_is_an_error(workspace, tok, corpus):
    """Checked once, as the corpus opens (before a model is built, and by the launcher before it submits)."""
    with pytest.raises(DataError, match="fewer than one global batch"):
        check_corpus_size(corpus, training(mbs=corpus.num_train_samples, accum=2))
    with pytest.raises(DataError, match="data.path: the train split has .* fewer than one global batch"):
        open_corpus(config(workspace, tokenized(workspace, tok), f"training.global_batch_size={8 * SEQ_LEN**2}"))
    too_many = corpus.num_val_samples // 8 + 1
    with pytest.raises(DataError, match="re-run `nanotron tokenize` .* with a larger --validation_split"):
        check_corpus_size(corpus, training(eval_steps=too_many))
    with pytest.raises(DataError, match=f"needs training.eval_steps \\* global_batch_size = {too_many} \\* 8"):
        eval_batches(corpus, training(eval_steps=too_many), dp=1, dp_rank=0)
    check_corpus_size(corpus, training(eval_steps=too_many, eval_interval=0))


@pytest.fixture(scope="module")
def blend(tiny_data, tmp_path_factory) -> list[str]:
    """Two tokenized dirs in tiny_data's vocabulary, blended 0.7 / 0.3 (the command-line form of [[data.datasets]])."""
    from conftest import synthetic_documents

    root, tok = tmp_path_factory.mktemp("blend"), load_tokenizer(tiny_data.tokenizer)
    for name, seed in (("first", 0), ("second", 1)):
        write_jsonl(root / name / "docs.jsonl", synthetic_documents(40, seed=seed))
        tokenize(resolve_sources([str(root / name)]), tok, root / f"{name}-tokens", shard_tokens=3000, progress=False)
    return [*tiny_data.overrides(), f"--data.datasets={root / 'first-tokens'}:0.7,{root / 'second-tokens'}:0.3"]


@pytest.mark.slow
def test_a_blended_run_matches_at_dp2_pp2_and_resumes_on_the_same_samples(blend, tmp_path):
    from conftest import TINY_MODEL, run_train, train_losses

    common = [*TINY_MODEL, *blend, f"--job.out_dir={tmp_path}", "--training.steps=6"]
    run_train([*common, "--job.name=ref", "--checkpoint.interval=3"])
    reference = train_losses(tmp_path / "ref")
    run_train([*common, "--job.name=layout", "--parallelism.dp=2", "--parallelism.pp=2"], nproc=4)
    assert torch.allclose(torch.tensor(train_losses(tmp_path / "layout")), torch.tensor(reference), rtol=1e-5, atol=0)
    run_train([*common, "--job.name=resumed", f"--checkpoint.resume_from={tmp_path / 'ref/checkpoints/step-3'}"])
    assert train_losses(tmp_path / "resumed") == reference[3:]  # bit for bit: the same samples, in the same order


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_token_id_beyond_the_vocabulary_is_one_line(workspace, tok, tmp_path, num_workers):
    """Bit rot that keeps the file size (or a shard from another tokenizer) must not reach the embedding as an
    IndexError: the sample that reads it is refused, naming the shard file, the sample and the id, also when
    a DataLoader worker read it."""
    directory = tokenized(workspace, tok, seed=11)
    shard = directory / "train-00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[5] = 60000  # >= the tokenizer's vocabulary (300)
    tokens.tofile(shard)
    corpus = open_corpus(config(workspace, directory))
    loader = build_train_loader(corpus, training(), seed=0, dp=1, dp_rank=0, num_workers=num_workers)
    gc.disable()  # the workers must end when the error is raised, not whenever a garbage collection runs
    try:
        with pytest.raises(DataError) as info:
            for batch in take_forever(loader):
                del batch
        # They ignore stop signals, so a worker left behind hangs the process's exit (it joins its children).
        deadline = time.monotonic() + 10
        while multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not multiprocessing.active_children()
    finally:
        gc.enable()
    message = str(info.value)
    assert "\n" not in message, message
    assert f"token file '{shard}'" in message and "id 60000" in message and "vocabulary of 300" in message
    assert re.search(r"global sample \d+", message), message


def take_forever(loader):
    for _, batch in zip(range(10_000), loader_batches(loader)):
        yield batch


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("dtype", "garbage", "'dtype' is 'garbage', expected 'uint16' or 'uint32'"),
        ("dtype", "uint64", "'dtype' is 'uint64', expected 'uint16' or 'uint32'"),  # said "missing or unreadable"
        ("dtype", "float16", "'dtype' is 'float16', expected 'uint16' or 'uint32'"),
        ("shards", "abc", "'shards' is 'abc', expected a list of shard records"),
        ("tokenizer", 5, "'tokenizer' is 5, expected a table with 'fingerprint' and 'path'"),
        ("eos_id", "x", "'eos_id' is 'x', expected an integer >= 0"),
    ],
)
def test_meta_json_fields_of_the_wrong_type_are_one_line_naming_the_field(
    workspace, tok, tmp_path, field, value, expected
):
    directory = tmp_path / "copy"
    shutil.copytree(tokenized(workspace, tok, seed=13), directory)
    meta = json.loads((directory / "meta.json").read_text())
    meta[field] = value
    (directory / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError) as info:
        open_corpus(config(workspace, directory))
    assert expected in str(info.value) and str(directory / "meta.json") in str(info.value)
