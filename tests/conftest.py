"""Shared fixtures: a synthetic corpus with its own tokenizer, and a runner for real training processes."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import random
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

# Made-up sentences (learnable, no third-party text) and the documented training launch, as the benchmarks use them.
from benchmarks.common import REPO, WORDS, synthetic_documents, train_command


@dataclass
class TinyData:
    corpus: Path  # the raw documents (docs.jsonl)
    tokenizer: Path
    tokenized: Path  # the corpus as `nanotron tokenize` writes it, with its defaults
    task: Path | None = None  # a multiple-choice evaluation task (tiny_task)

    def overrides(self) -> list[str]:
        return [f"--data.path={self.tokenized}", f"--data.tokenizer={self.tokenizer}"]


def tiny_data_of(root: Path, docs: list[str], tokenizer_docs: list[str]) -> TinyData:
    """`docs` as a JSONL corpus, a 512-token BPE trained on `tokenizer_docs`, and the corpus tokenized by
    `nanotron tokenize`'s own function with its defaults (validation split 0.05, seed 0, one shard)."""
    from nanotron.tokenize.bpe import train_tokenizer
    from nanotron.tokenize.writer import tokenize_paths

    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_tokenizer(tokenizer_docs, root / "tokenizer", vocab_size=512)
    tokenize_paths([str(corpus)], root / "tokenizer", root / "tokens", progress=False)
    return TinyData(corpus, root / "tokenizer", root / "tokens")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    root = tmp_path_factory.mktemp("tiny_data")
    docs = synthetic_documents(60)
    data = tiny_data_of(root, docs, docs)
    data.task = tiny_task(root / "task.jsonl")
    return data


def pytest_collection_modifyitems(config, items):
    """Multi-process tests first, then the quick ones, then the `exclusive` ones: under two workers the
    exclusive tests then wait for each other only, not for a long shared test on the other worker, and the
    shared phase ends on short tests (stable: file order within each group). The shared `cluster` tests (one
    at a time) are spread evenly over the multi-process ones, so that the two workers seldom want the
    cluster at once."""
    items.sort(key=lambda item: (item.get_closest_marker("exclusive") is not None, not item.get_closest_marker("slow")))
    spread = [item for item in items if item.get_closest_marker("cluster") and not item.get_closest_marker("exclusive")]
    if not spread:
        return
    rest = [item for item in items if item not in spread]
    n_slow = sum(1 for item in rest if item.get_closest_marker("slow") and not item.get_closest_marker("exclusive"))
    step = max(n_slow // (len(spread) + 1), 1)
    for k, item in enumerate(spread):
        rest.insert(min((k + 1) * step + k, len(rest)), item)
    items[:] = rest


@pytest.fixture(autouse=True)
def _cpu_share(request, tmp_path_factory):
    """Under `make test`'s two pytest-xdist workers: a test marked `exclusive` (it times ranks: hang and
    straggler detection, the doctor) runs alone, as on a quiet machine; the others run two at a time. A
    readers-writer lock over the session's temp root, with a turnstile so that a waiting exclusive test is not
    starved by the other worker's stream of shared ones. A test marked `cluster` (it submits to the local Slurm
    cluster, whose nodes the jobs take whole) first takes the cluster's own lock: one such test at a time,
    beside the other worker's shared tests (taken before the CPU locks, so the two never deadlock)."""
    with contextlib.ExitStack() as held:
        if "PYTEST_XDIST_WORKER" in os.environ:
            root = tmp_path_factory.getbasetemp().parent
            exclusive = request.node.get_closest_marker("exclusive") is not None
            if request.node.get_closest_marker("cluster") is not None:
                cluster = held.enter_context(open(root / "cluster.lock", "a"))
                fcntl.flock(cluster, fcntl.LOCK_EX)
            turnstile = held.enter_context(open(root / "turnstile.lock", "a"))
            share = held.enter_context(open(root / "share.lock", "a"))
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(share, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        with _ends_its_processes(request.node.nodeid):  # before the locks are let go
            yield


def _interpreter_helper(proc: Path) -> bool:
    """multiprocessing's resource tracker (or fork server): started by a test's first spawn context (the tokenizer's
    workers), it serves the pytest worker's interpreter for its lifetime, not the test."""
    return b"from multiprocessing." in (proc / "cmdline").read_bytes()


TEST_VARIABLE = "NANOTRON_TEST"  # in the environment of every process a test starts: which test started it
_tests_run = itertools.count()


@contextlib.contextmanager
def _ends_its_processes(nodeid: str):
    """A test's processes do not outlive it. One that failed or timed out mid-run (pytest-timeout) would otherwise
    leave ranks training, or waiting in a collective for distributed.timeout_minutes, beside every test after it:
    each process it started (the marker in its /proc environ, which forked ranks share with their launcher, and
    which a rank's own session does not hide) is SIGKILLed when it ends, and named in a warning."""
    outer, value = os.environ.get(TEST_VARIABLE), f"{os.getpid()}.{next(_tests_run)}"
    marker = f"{TEST_VARIABLE}={value}".encode()
    os.environ[TEST_VARIABLE] = value
    try:
        yield
    finally:
        if outer is None:
            os.environ.pop(TEST_VARIABLE, None)
        else:
            os.environ[TEST_VARIABLE] = outer
        left = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            with contextlib.suppress(OSError):
                if marker in environ.read_bytes().split(b"\0") and not _interpreter_helper(environ.parent):
                    left.append(int(environ.parent.name))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if left:
            warnings.warn(f"{nodeid} left {len(left)} process(es) running; killed: {left}", stacklevel=1)


@pytest.fixture(scope="session")
def references(request, tmp_path_factory):
    """Each layout-matrix family's 1-process run (tests/matrix.py), made on first use and shared by the session."""
    from matrix import References

    return References(request, tmp_path_factory)


def tiny_task(path: Path, n_items: int = 7, seed: int = 5) -> Path:
    """Multiple-choice items in the native layout: 7, with 3 and 4 choices (25 rows: no dp divides them),
    and one context longer than a 16-token row (cut from the left)."""
    rng, items = random.Random(seed), []
    for index, doc in enumerate(synthetic_documents(n_items, seed=99)):
        words = doc.split(". ")[0].split()
        n = 4 if index % 2 or index == n_items - 1 else 3  # 25 rows for 7 items: odd, no dp divides them
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(n - 1)]
        gold = rng.randrange(n)
        choices.insert(gold, " ".join(words[2:5]))
        context = " ".join(words[:2]) if index != 3 else " ".join(rng.choice(WORDS) for _ in range(40))
        items.append({"context": context, "choices": choices, "gold": gold})
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def item_log_likelihoods(run_dir: Path, step: int) -> list[float]:
    """Every (item, choice) log-likelihood of an evaluation written with evaluation.write_items, in order."""
    lines = (run_dir / "evaluation" / f"step-{step}.jsonl").read_text().splitlines()
    return [value for line in lines for value in json.loads(line)["log_likelihoods"]]


@pytest.fixture(scope="session")
def short_docs_data(tmp_path_factory) -> TinyData:
    """Documents of 1-3 short sentences (5-40 tokens): several EOS tokens in most 16-token samples, so
    document masking has documents that cross sequence chunks and tokens without a loss."""
    rng = random.Random(1)
    docs = [
        " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))).capitalize() + "." for _ in range(3))
        if i % 4 == 0
        else " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))).capitalize() + "."
        for i in range(3000)
    ]
    return tiny_data_of(tmp_path_factory.mktemp("short_docs"), docs, synthetic_documents(60))


# A model small enough for 8 ranks on 2 cores, with GQA, 4 layers and a vocab divisible by tp.
TINY_MODEL = [
    "--model.hidden_size=32",
    "--model.intermediate_size=64",
    "--model.num_layers=4",
    "--model.num_heads=4",
    "--model.num_kv_heads=2",
    "--model.vocab_size=512",
    "--model.max_seq_len=32",
    "--training.seq_len=16",
    "--training.micro_batch_size=2",
    "--training.global_batch_size=8",
    "--training.grad_accum_steps=0",
    "--training.eval_interval=0",
    "--logging.log_interval=1",
    "--logging.tensorboard=false",
    "--logging.peak_tflops=1",
    "--optimizer.warmup_steps=2",
]

# TINY_MODEL under µP at 2x the width and 2x the depth of its base (4 heads of 4, MLP 32, 2 layers).
TINY_MUP = [
    "--model.parametrization=mup",
    "--model.mup_base.hidden=16",
    "--model.mup_base.heads=4",
    "--model.mup_base.intermediate=32",
    "--model.mup_base.layers=2",
]

FORKRUN = Path(__file__).with_name("forkrun.py")


WORKER_ENVIRONMENT = dict(os.environ)  # before any test's monkeypatch.setenv


def train_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        **(os.environ if base is None else base),
        "OMP_NUM_THREADS": "1",
        # A rank killed by a fatal signal (SIGSEGV, SIGABRT) prints every thread's Python stack into the output
        # the failing test shows: without it, a crash under load leaves only torchrun's exit code.
        "PYTHONFAULTHANDLER": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }
    env.pop("RANK", None)
    return env


def run_train(
    args: list[str], nproc: int = 1, cwd: Path = REPO, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs `python -m nanotron.train` in one process, or as `nproc` ranks forked by tests/forkrun.py (torchrun's
    environment and exit, without each rank's own imports: half the CPU of a 4-rank tiny run), either forked by
    this worker's tests/zygote.py (the imports done once per worker, not once per run)."""
    command = train_command(1, args) if nproc == 1 else [sys.executable, str(FORKRUN), str(nproc), *args]
    proc = ZYGOTE.run(command, args, nproc, cwd, train_env(), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


class Zygote:
    """The client of this worker's tests/zygote.py, started on first use and stopped with the session."""

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None
        self.path = ""
        self.failed = False

    def ready(self) -> bool:
        """Started (on first use, again if it died); False, with one warning, where it cannot start: the runs are
        then fresh interpreters, slower but the same."""
        if self.failed:
            return False
        if self.server is None or self.server.poll() is not None:
            try:
                self.start()
            except (OSError, RuntimeError) as error:
                self.stop()
                self.failed = True
                warnings.warn(f"tests/zygote.py unavailable, runs start fresh interpreters: {error}", stacklevel=2)
                return False
        return True

    def start(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="zygote-", dir="/tmp"), "socket")  # AF_UNIX: < 108 bytes
        # imported with the worker's own environment, not that of the test that happens to start it
        env = train_env(WORKER_ENVIRONMENT)
        command = [sys.executable, str(Path(__file__).with_name("zygote.py")), self.path]
        self.server = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tests/zygote.py did not start (exit {self.server.poll()})")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)
            self.server = None

    def run(self, command, args, nproc, cwd, env, timeout, module: str | None = None) -> subprocess.CompletedProcess:
        """subprocess.run(command, cwd, env, capture_output=True, text=True, timeout) for a training command (or
        `python -m module args`): forked from the server, or that very call where there is none
        (NANOTRON_TEST_ZYGOTE=0: fresh interpreters, to compare)."""
        if os.environ.get("NANOTRON_TEST_ZYGOTE", "1") == "0" or not self.ready():
            return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        chunks, reply = {out_read: [], err_read: []}, {}
        try:
            with open(os.devnull) as stdin, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                request = {"args": list(args), "nproc": nproc, "env": dict(env), "cwd": str(cwd), "module": module}
                socket.send_fds(conn, [json.dumps(request).encode()], [stdin.fileno(), out_write, err_write])
                os.close(out_write)
                os.close(err_write)
                out_write = err_write = -1
                self.read_until_exit(conn, chunks, reply, time.monotonic() + timeout, command, timeout)
        except BaseException:
            if "pid" in reply and "rc" not in reply:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(reply["pid"], signal.SIGKILL)  # as subprocess.run does: its ranks stop with it (forkrun)
            raise
        finally:
            for fd in (out_read, err_read, out_write, err_write):
                if fd >= 0:
                    os.close(fd)
        stdout, stderr = (self.text(chunks[fd]) for fd in (out_read, err_read))
        return subprocess.CompletedProcess(command, reply["rc"], stdout, stderr)

    def read_until_exit(self, conn, chunks: dict[int, list[bytes]], reply: dict[str, int], deadline, command, timeout):
        """Collects the run's two streams (to their ends) into `chunks` and the handler's "pid N" and "rc N" lines
        into `reply`, until all three are in."""
        pending = b""
        with selectors.DefaultSelector() as selector:
            for fd in (*chunks, conn.fileno()):
                selector.register(fd, selectors.EVENT_READ)
            while "rc" not in reply or any(fd in selector.get_map() for fd in chunks):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(command, timeout, *(self.text(c) for c in chunks.values()))
                for key, _ in selector.select(min(left, 1.0)):
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        selector.unregister(key.fd)
                    elif key.fd in chunks:
                        chunks[key.fd].append(data)
                    else:  # whole lines only
                        *lines, pending = (pending + data).split(b"\n")
                        reply.update((word.decode(), int(number)) for word, number in (line.split() for line in lines))
                if "rc" not in reply and conn.fileno() not in selector.get_map():
                    raise RuntimeError("tests/zygote.py's handler ended without the run's exit code")

    @staticmethod
    def text(chunks: list[bytes]) -> str:
        """As subprocess's text mode decodes: universal newlines."""
        return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


ZYGOTE = Zygote()


def pytest_sessionfinish(session, exitstatus):
    ZYGOTE.stop()


# What the ranks of the tests that start processes themselves import before their work: the fork server imports it
# once per pytest worker.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "nanotron.parallel.context"]


@pytest.fixture
def forkserver():
    """multiprocessing's "forkserver" context for a test that starts its ranks itself: each process is forked from
    one single-threaded server per pytest worker that imported torch and the parallel modules once, where a
    "spawn" context starts a fresh interpreter (~4 s of CPU) per process. The server's children carry the marker of
    the test that started the server, not their own: what this test leaves running is killed here instead."""
    import multiprocessing

    import torch.multiprocessing

    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    yield context
    for process in multiprocessing.active_children():
        process.kill()


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def activation_stats(run_dir: Path) -> dict[int, dict[str, float]]:
    """The `act/*` values of each step that logged them."""
    records = (r for r in read_metrics(run_dir) if "act/embed" in r)
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("act/")} for r in records}


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def popen_train(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nanotron.train", *args],
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


CONSOLE_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")  # what nanotron.console puts in front


def console_message(line: str) -> str:
    """A console line without its time of day."""
    return CONSOLE_TIME.sub("", line, count=1)


def console_messages(output: str) -> list[str]:
    return [console_message(line) for line in output.strip().splitlines()]


def wait_for_training(proc: subprocess.Popen) -> list[str]:
    """Reads output until the first step line: the trainer is past start-up and its signal handlers."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if console_message(line).startswith("step "):
            return lines
    raise AssertionError("training never started:\n" + "".join(lines))


def child_pids(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


WATCHER_COMMAND = b"\0nanotron\0watcher\0"


def worker_pids(launcher: int) -> list[int]:
    """The training processes a launcher started (its children, less the node's watcher process)."""
    return [pid for pid in child_pids(launcher) if WATCHER_COMMAND not in _cmdline(pid)]


def watcher_pids(launcher: int) -> list[int]:
    """The node's watcher process a launcher started (one, once it runs)."""
    return [pid for pid in child_pids(launcher) if WATCHER_COMMAND in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def shapes_of(step_dir: Path) -> dict:
    """The parameter shapes a checkpoint's config.toml implies (what its weights are read against)."""
    from nanotron.checkpoint.full_model import expected_shapes
    from nanotron.config import read_model_config

    return expected_shapes(read_model_config(step_dir / "config.toml"))


class Box:
    """The smallest stateful component: a dict of tensors (or of JSON values, for progress)."""

    def __init__(self, **state):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)
