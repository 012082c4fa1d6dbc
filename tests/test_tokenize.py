"""`nanotron tokenize`: sources → sharded token files, identical for any number of workers, resumable after a
kill, one `error:` line for bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_pids, console_message

from nanotron.commands import tokenize as cli
from nanotron.errors import DataError
from nanotron.tokenize import encode
from nanotron.tokenize.bpe import train_tokenizer
from nanotron.tokenize.format import META, PROGRESS
from nanotron.tokenize.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
WORDS = "thou art the king of all my love and hate fair foul night day sword crown heaven earth sweet".split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        f"DOCUMENT {i}.\n\n"
        + "\n\n".join(" ".join(rng.choice(WORDS, rng.integers(5, 30))) for _ in range(rng.integers(1, 6)))
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokenize")
    docs = documents(300)
    write_jsonl(root / "corpus" / "a.jsonl", [{"text": d} for d in docs[:200]])
    write_jsonl(root / "corpus" / "b.jsonl", [{"text": d} for d in docs[200:]])
    train_tokenizer(docs, root / "tokenizer", vocab_size=300)
    return root


def tokenize(corpus: Path, out: Path, *extra: str) -> int:
    args = [str(corpus / "corpus"), "--tokenizer", str(corpus / "tokenizer"), "--out", str(out), "--quiet"]
    return cli.main([*args, "--shard_tokens", "4000", "--validation_split", "0.1", *extra])


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_one_and_two_workers_write_identical_files(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "BATCH_CHARS", 2000)  # ~30 batches in flight across the workers
    assert tokenize(corpus, tmp_path / "one", "--workers", "1") == 0
    assert tokenize(corpus, tmp_path / "two", "--workers", "2") == 0
    one, two = files(tmp_path / "one"), files(tmp_path / "two")
    assert len([name for name in one if name.startswith("train-")]) > 4  # several shards, both splits written
    assert one.keys() == two.keys() and all(one[name] == two[name] for name in one)
    meta = json.loads(one[META])
    tokenizer = load_tokenizer(corpus / "tokenizer")
    assert (meta["eos_id"], meta["dtype"], meta["rows"]) == (tokenizer.eos_id, "uint16", 300)
    assert meta["documents"] == {"train": 270, "val": 30}  # exactly the validation fraction, document by document
    assert meta["tokenizer"]["fingerprint"] == tokenizer.fingerprint


def test_progress_is_a_line_every_interval_when_the_output_is_not_a_terminal(corpus, tmp_path, capsys, monkeypatch):
    """A Slurm log is no terminal: no progress bar there, but timestamped progress lines (every 30 s; here every
    batch), then the summary."""
    from nanotron.tokenize import writer

    monkeypatch.setattr(writer, "PROGRESS_SECONDS", 0.0)
    args = [str(corpus / "corpus"), "--tokenizer", str(corpus / "tokenizer"), "--out", str(tmp_path / "out")]
    assert cli.main(args) == 0
    lines = [console_message(line) for line in capsys.readouterr().out.splitlines()]
    progress = [line for line in lines if line.startswith(f"tokenize {tmp_path / 'out'}: ")]
    assert progress and all(
        re.search(r": [\d,]+ documents, [\d.]+k? tokens so far \([\d.]+M tokens/s\)$", p) for p in progress
    )
    assert lines[-1].startswith("tokenize: ")  # the summary


def test_a_finished_output_is_reused_and_another_input_refused(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert tokenize(corpus, out, "--workers", "1") == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert tokenize(corpus, out, "--workers", "1") == 0
    assert "reused" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    train_tokenizer(documents(50), tmp_path / "other_tokenizer", vocab_size=280)
    other = ["--tokenizer", str(tmp_path / "other_tokenizer"), "--workers", "1"]
    assert tokenize(corpus, out, *other) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out: '{out}' holds the tokens of another input")
    assert "another tokenizer" in err[0] and "--overwrite" in err[0]
    assert tokenize(corpus, out, *other, "--overwrite") == 0
    assert json.loads((out / META).read_text())["vocab_size"] == 280


def test_a_folder_of_other_files_is_not_written_into(corpus, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert tokenize(corpus, tmp_path, "--workers", "1") == 2
    assert "already holds other files (notes.txt)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["notes.txt"]


@pytest.mark.parametrize("inside", [False, True], ids=["a file", "a path inside a file"])
def test_an_out_that_is_a_file_is_one_line_and_the_file_is_kept(corpus, tmp_path, capsys, inside):
    (tmp_path / "corpus.jsonl").write_text('{"text": "mine"}\n')
    out = tmp_path / "corpus.jsonl" / "tokens" if inside else tmp_path / "corpus.jsonl"
    assert tokenize(corpus, out, "--workers", "1") == 2
    err = capsys.readouterr().err.strip()
    expected = f"error: --out: '{out}' " + ("is inside a file" if inside else "is a file")
    assert len(err.splitlines()) == 1 and err.startswith(expected) and "new or empty folder" in err, err
    assert (tmp_path / "corpus.jsonl").read_text() == '{"text": "mine"}\n'


@pytest.mark.parametrize("progress", [b"{", b"[]", b'{"shards": []}', b"\xff"])
def test_an_unreadable_progress_file_is_one_line_and_kept(corpus, tmp_path, capsys, progress):
    """An interrupted run's progress.json says which shards to keep; one that is not what tokenize writes (bit rot,
    a hand edit) was a traceback. It is one line naming it and the way out, and nothing in the folder changes."""
    out = tmp_path / "tokens"
    out.mkdir()
    (out / "progress.json").write_bytes(progress)
    assert tokenize(corpus, out, "--workers", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --out: '{out / 'progress.json'}' is not"), err
    assert "--overwrite" in err and sorted(p.name for p in out.iterdir()) == [".lock", "progress.json"]  # the lock
    assert (out / "progress.json").read_bytes() == progress


@pytest.mark.slow
def test_killed_after_a_shard_commit_resumes_and_ends_identical(corpus, tmp_path):
    """SIGKILL once the first shards are committed, then the same command finishes the job (at another worker
    count): the files are those of an uninterrupted run."""
    assert tokenize(corpus, tmp_path / "whole", "--workers", "1") == 0
    big = tmp_path / "big"
    docs = documents(3000, seed=1)
    write_jsonl(big / "corpus" / "c.jsonl", [{"text": d} for d in docs])
    (big / "tokenizer").symlink_to(corpus / "tokenizer")
    assert tokenize(big, tmp_path / "reference", "--workers", "1") == 0
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "nanotron", "tokenize", str(big / "corpus"), "--tokenizer", str(big / "tokenizer")]
    command += ["--out", str(out), "--quiet", "--shard_tokens", "4000", "--validation_split", "0.1", "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        progress = out / PROGRESS
        if progress.is_file() and len(json.loads(progress.read_text() or '{"shards": []}')["shards"]) >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / META).exists(), "the run ended before the kill"
    committed = json.loads((out / PROGRESS).read_text())["shards"]
    kept = {name: (out / name).stat() for shard in committed for name in shard["files"]}
    assert tokenize(big, out, "--workers", "1") == 0
    assert files(out) == files(tmp_path / "reference"), f"resumed after {len(committed)} shards"
    for name, before in kept.items():  # the committed shards were kept, not redone
        assert ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"text": 5}, "'text' of '{path}' line 2 holds 5 (int), expected a string"),
        ({"text": None}, "'text' of '{path}' line 2 holds null, expected a string"),
        ({"body": "x"}, "'text' is not a field of '{path}' line 2 (its fields: ['body'])"),
        ("[1, 2]", "'{path}' line 2 is a JSON list, expected an object with 'text'"),
    ],
)
def test_a_bad_row_is_one_error_line_naming_file_line_and_column(corpus, tmp_path, capsys, row, expected):
    path = write_jsonl(tmp_path / "src" / "bad.jsonl", [{"text": "fine"}, row if isinstance(row, dict) else [1, 2]])
    args = [str(path), "--tokenizer", str(corpus / "tokenizer"), "--out", str(tmp_path / "out"), "--workers", "1"]
    assert cli.main([*args, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected.format(path=path) in err[0], err


def test_invalid_json_and_a_null_in_parquet_name_the_row(corpus, tmp_path, capsys):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n\n{"text": \n')
    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "nulls.parquet")
    for source, expected in (("broken.jsonl", "line 3 is not valid JSON"), ("nulls.parquet", "row 2 holds null")):
        args = [
            str(tmp_path / source),
            "--tokenizer",
            str(corpus / "tokenizer"),
            "--out",
            str(tmp_path / f"o-{source}"),
        ]
        assert cli.main([*args, "--quiet", "--workers", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and source in err[0], err


def test_every_source_kind_gives_the_same_documents(corpus, tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    docs = documents(12, seed=3)
    write_jsonl(tmp_path / "jsonl" / "d.jsonl", [{"text": d} for d in docs])
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "d.json").write_text(json.dumps([{"text": d} for d in docs]))
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.table({"text": docs}), tmp_path / "parquet" / "d.parquet", row_group_size=5)
    (tmp_path / "txt").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(doc)
    outputs = []
    for kind in ("jsonl", "json", "parquet", "txt"):
        args = [str(tmp_path / kind), "--tokenizer", str(corpus / "tokenizer"), "--out", str(tmp_path / f"out-{kind}")]
        assert cli.main([*args, "--quiet", "--workers", "1", "--validation_split", "0"]) == 0
        outputs.append((tmp_path / f"out-{kind}" / "train-00000.bin").read_bytes())
    assert len(set(outputs)) == 1 and len(outputs[0]) > 0


def test_an_offline_hub_name_is_one_error_line_at_once(corpus, tmp_path, capsys, monkeypatch):
    args = ["someorg/some-dataset", "--tokenizer", str(corpus / "tokenizer"), "--out", str(tmp_path / "out")]
    started = time.perf_counter()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: SOURCE: 'someorg/some-dataset' is not a local file or folder")
    assert "HF_HUB_OFFLINE is set" in err[0]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1")  # nothing listens on 443: the probe fails at once
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "127.0.0.1:443 is unreachable" in err[0]
    assert time.perf_counter() - started < 5 and not (tmp_path / "out").exists()


def test_verify_reads_every_byte_and_names_a_changed_file(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert tokenize(corpus, out, "--workers", "1") == 0
    assert cli.main(["--verify", str(out)]) == 0
    shard = out / "train-00002.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1  # same size: only hashing sees it
    shard.write_bytes(bytes(data))
    assert cli.main(["--verify", str(out)]) == 2
    assert f"'{shard}' does not match its sha256" in capsys.readouterr().err


def test_bad_flags_are_one_line(corpus, tmp_path, capsys):
    base = [str(corpus / "corpus"), "--tokenizer", str(corpus / "tokenizer"), "--out", str(tmp_path / "o")]
    for extra, flag in ((["--workers", "0"], "--workers"), (["--validation_split", "1"], "--validation_split")):
        assert cli.main([*base, *extra]) == 2
        assert capsys.readouterr().err.strip() == f"error: {flag}: expected " + (
            "at least 1; see `nanotron tokenize --help`"
            if flag == "--workers"
            else "a fraction in [0, 1); see `nanotron tokenize --help`"
        )
    assert cli.main([str(tmp_path / "missing"), "--tokenizer", str(corpus / "tokenizer"), "--out", "o"]) == 2
    assert capsys.readouterr().err.startswith(f"error: SOURCE: '{tmp_path / 'missing'}' does not exist")


def test_a_hub_dataset_is_streamed_row_by_row_and_resumes_by_skipping(corpus, tmp_path, monkeypatch, capsys):
    """The streaming path without a network: `datasets.load_dataset(..., streaming=True)` stubbed by rows."""
    import datasets

    from nanotron.tokenize.sources import Source, iter_documents

    rows = [{"text": d} for d in documents(5)]
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    source = Source("org/set", hub="org/set", hub_config="en", hub_split="train")
    assert list(iter_documents([source], "text", start=2)) == [r["text"] for r in rows[2:]]
    assert calls == [("org/set", "en", "train", True)]
    rows[3] = {"text": 7}
    with pytest.raises(DataError, match=r"'text' of hub dataset 'org/set' row 3 holds 7 \(int\)"):
        list(iter_documents([source], "text"))


@pytest.mark.slow
def test_sigterm_stops_in_one_line_with_exit_130_and_no_worker_left(corpus, tmp_path):
    big = tmp_path / "big"
    write_jsonl(big / "c.jsonl", [{"text": d} for d in documents(3000, seed=2)])
    out = tmp_path / "out"
    command = [sys.executable, "-m", "nanotron", "tokenize", str(big), "--tokenizer", str(corpus / "tokenizer")]
    command += ["--out", str(out), "--shard_tokens", "4000", "--workers", "2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        (out / PROGRESS).is_file() and json.loads((out / PROGRESS).read_text() or '{"shards": []}')["shards"]
    ):
        time.sleep(0.01)
    workers = child_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and not (out / META).exists(), err
    assert err.strip() == f"interrupted: {out} keeps its committed shards; re-run the same command to resume"
    assert len(workers) >= 2  # the workers (and multiprocessing's resource tracker) end with it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [pid for pid in workers if Path(f"/proc/{pid}").exists()]:
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


def test_a_run_that_died_mid_shard_leaves_nothing_behind_once_resumed(corpus, tmp_path, monkeypatch):
    """Injected: the process dies after two commits, in the middle of writing the third shard's index (the
    temporaries a SIGKILL leaves: the open shard, write_atomic's tmp files); the re-run ends as an uninterrupted run."""
    from nanotron.tokenize import writer

    assert tokenize(corpus, tmp_path / "reference", "--workers", "1") == 0
    commit, commits = writer.ShardWriter.commit, []

    def dying_commit(self):
        if len(commits) == 2:
            (self.out / f".{self._partial('train', 'idx').name}.tmp999").write_bytes(b"half")
            (self.out / ".progress.json.tmp999").write_text("{")
            raise SystemExit("killed")
        commits.append(commit(self))

    monkeypatch.setattr(writer.ShardWriter, "commit", dying_commit)
    with pytest.raises(SystemExit):
        tokenize(corpus, tmp_path / "out", "--workers", "1")
    monkeypatch.setattr(writer.ShardWriter, "commit", commit)
    assert len(json.loads((tmp_path / "out" / PROGRESS).read_text())["shards"]) == 2
    assert tokenize(corpus, tmp_path / "out", "--workers", "1") == 0
    assert files(tmp_path / "out") == files(tmp_path / "reference")


def test_workers_ignore_every_stop_signal_the_trainer_handles(monkeypatch):
    """A trainer tokenizing a small corpus at start-up traps SIGUSR1 too (Slurm's --signal): a signal to the
    whole process group must not kill its tokenize workers (SIGUSR1's default action ends a process)."""
    import multiprocessing

    from nanotron.signals import STOP_SIGNALS

    monkeypatch.setattr(encode, "Encoder", lambda *args: None)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def worker():
        encode._init_worker(os.getppid(), "", 0, "uint16")
        queue.put({signal.Signals(s).name: signal.getsignal(s) == signal.SIG_IGN for s in STOP_SIGNALS})

    process = context.Process(target=worker)
    process.start()
    assert queue.get(timeout=60) == {"SIGUSR1": True, "SIGTERM": True, "SIGINT": True}
    process.join(timeout=60)
