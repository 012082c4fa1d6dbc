"""Shared pieces of the benchmarks: a synthetic corpus, launching real training runs, tables.

Every benchmark runs from a fresh clone: the corpus is made-up text with its own small tokenizer
(no download, no third-party text), written once under the work dir and reused.
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import traceback
import types
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORK_DIR = REPO / ".cache" / "benchmarks"
RESULTS_DIR = REPO / "benchmarks" / "results"
WORDS = (
    "the a one two red blue small large cat dog bird tree house river stone light dark quick slow runs "
    "sees makes finds under over near far before after and but so then we they it is was will"
).split()

# No checkpoints (saved or resumed) and no TensorBoard: every benchmark run, timed or swept.
NO_OUTPUTS = [
    "--checkpoint.save_final=false",
    "--checkpoint.interval=0",
    "--checkpoint.resume_from=none",
    "--logging.tensorboard=false",
]
# Keys every timed benchmark run shares: those, no evaluation in the timed loop, one metrics record per
# step, and a constant LR (the schedule's cost is the same at any LR).
QUIET_RUN = [
    *NO_OUTPUTS,
    "--training.eval_interval=0",
    "--logging.log_interval=1",
    "--optimizer.warmup_steps=0",
    "--optimizer.decay_style=constant",
]


# Benchmark models as `--model.*`/`--training.seq_len` overrides. "nano" is for smoke tests (seconds);
# "tiny" is the tiny preset (embedding and head are 70% of its weights); "small" (7.9M) is shaped like
# a real LLM (the head ~7% of the matmul work, 8 layers to balance over pipeline stages) and is big
# enough that one rank's step (~1 s per 2048 tokens on one core) dwarfs per-step framework and gloo
# costs, which scaling measurements need; "1b" is the GPU check's ~1.1B model (TinyLlama's shape).
MODELS: dict[str, dict[str, int]] = {
    "nano": dict(
        hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=1024, seq_len=32
    ),
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=8192, seq_len=128
    ),
    "small": dict(
        hidden_size=256, intermediate_size=768, num_layers=8, num_heads=4, num_kv_heads=4, vocab_size=2048, seq_len=256
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        vocab_size=32000,
        seq_len=2048,
    ),
}


def model_overrides(size: str) -> list[str]:
    """The size's shape as overrides (max_seq_len = seq_len: RoPE tables no longer than needed)."""
    shape = dict(MODELS[size])
    seq_len = shape.pop("seq_len")
    return [f"--model.{k}={v}" for k, v in shape.items()] + [
        f"--model.max_seq_len={seq_len}",
        f"--training.seq_len={seq_len}",
    ]


def bench_env(threads: int = 1) -> dict[str, str]:
    """One math thread per rank (ranks share the cores), offline hubs, and this checkout on the path."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def synthetic_documents(n_docs: int, seed: int = 0) -> list[str]:
    """Sentences drawn from a small word list: enough tokens to feed any benchmark, nothing to license."""
    rng = random.Random(seed)
    return [
        " ".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
            for _ in range(rng.randint(20, 40))
        )
        for _ in range(n_docs)
    ]


def synthetic_data(work_dir: Path, n_docs: int = 1200, vocab_size: int = 1024) -> tuple[Path, Path]:
    """(JSONL corpus, tokenizer dir) of the synthetic text, written once under `work_dir` per (n_docs, vocab_size):
    benchmarks sharing a work dir each get the corpus they ask for, whichever ran first."""
    from nanotron.tokenize.bpe import train_tokenizer

    root = work_dir / "data" / f"synthetic-{n_docs}docs-{vocab_size}vocab"
    corpus, tokenizer = root / "corpus" / "docs.jsonl", root / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        docs = synthetic_documents(n_docs)
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        train_tokenizer(docs, tokenizer, vocab_size=vocab_size)
    return corpus, tokenizer


def ensure_data(work_dir: Path, n_docs: int = 1200, vocab_size: int = 1024) -> list[str]:
    """The `--data.*` overrides of the synthetic text (`synthetic_data`), tokenized once."""
    corpus, tokenizer = synthetic_data(work_dir, n_docs, vocab_size)
    return data_overrides(corpus.parent, tokenizer, tokenizer.parent / "tokens")


def data_overrides(corpus: Path, tokenizer: Path, tokens: Path) -> list[str]:
    """`--data.*` overrides for `corpus`, tokenized into `tokens` first (`nanotron tokenize`'s defaults; a finished
    dir of the same corpus and tokenizer is reused)."""
    from nanotron.tokenize.writer import tokenize_paths

    tokenize_paths([str(corpus)], tokenizer, tokens, progress=False)
    return [f"--data.path={tokens}", f"--data.tokenizer={tokenizer}"]


def bench_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """`python -m benchmarks.<name>`'s flags: its docstring, as written, for --help; no abbreviated flags."""
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )


def parse_or_work(
    parser: argparse.ArgumentParser, argv: list[str] | None, worker: Callable[[list[str], Path], None]
) -> argparse.Namespace:
    """The benchmark's flags; in a `--worker` process (one measured run the benchmark started) it runs
    `worker(training args, --out)` instead and ends as nanotron.train does: no interpreter teardown after gloo."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.worker:
        from nanotron.errors import exit_process

        worker(rest, args.out)
        exit_process(0)
    return args


def train_command(nproc: int, args: Sequence[str]) -> list[str]:
    """`python -m nanotron.train` for one process, under torchrun for more (the documented launches)."""
    if nproc == 1:
        return [sys.executable, "-m", "nanotron.train", *args]
    return torchrun_command(nproc, ["nanotron.train", *args])


def torchrun_command(nproc: int, module_args: Sequence[str]) -> list[str]:
    """`python -m <module> <args>` under torchrun with `nproc` processes on this machine."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, "-m", *module_args]


# Set by the test suite (tests/test_benchmarks.py) to its fork launcher, tests/forkrun.py: a `--quick` benchmark then
# forks its training runs from its own process, which imported torch and the trainer once, instead of starting a
# fresh interpreter per rank (~4 s of CPU each on the 2-core test machine, half of a quick benchmark's time).
FORK_LAUNCHER = "NANOTRON_BENCH_FORK_LAUNCHER"


def launch_nanotron(name: str, args: Sequence[str], nproc: int, work_dir: Path) -> tuple[subprocess.Popen, Path]:
    """Starts one fresh training run (its run dir is wiped first: metrics.jsonl appends)."""
    run_dir = work_dir / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [*args, f"--job.out_dir={run_dir.parent}", f"--job.name={name}"]
    popen = subprocess.Popen
    if os.environ.get(FORK_LAUNCHER):
        popen = functools.partial(ForkedRun, lambda: _run_training(nproc, args))
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = popen(train_command(nproc, args), cwd=REPO, env=bench_env(), text=True, **pipes)
    return proc, run_dir


class ForkedRun(subprocess.Popen):
    """`subprocess.Popen(command, ...)` whose process is forked from this one instead of executed: the streams,
    directory and environment as given, then `child()`, what the command would have run (`_run_training`: a training
    run; `run_code`: a `python -c` program). Waiting, communicate, terminate and kill are Popen's own."""

    def __init__(self, child: Callable[[], None], *popen_args, **popen_kwargs):
        self.child = child
        for stream in (sys.stdout, sys.stderr):  # not written again by the child
            stream.flush()
        super().__init__(*popen_args, **popen_kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):  # fmt: skip
        pid = os.fork()
        if pid == 0:
            try:
                for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                    if fd != -1:
                        os.dup2(fd, target)
                # streams over those descriptors, as a fresh interpreter's (this process's may be a capture's)
                sys.stdin, sys.stdout, sys.stderr = (os.fdopen(fd, m, closefd=False) for fd, m in enumerate("rww"))
                if cwd is not None:
                    os.chdir(cwd)
                if env is not None:
                    os.environ.clear()
                    os.environ.update(env)
                _as_fresh_process()
                self.child()
            finally:
                os._exit(1)  # not reached: the run ends the process
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def run_train_command(command: list[str], stdout=None, stderr=None) -> subprocess.CompletedProcess:
    """`subprocess.run(command, stdout=..., stderr=...)` of a `python -m nanotron.train ARGS [--nproc_per_node N]`
    that package code starts itself (the coordinate check's member runs), forked as `ForkedRun` forks a benchmark's
    runs: what `subprocess` is to that code under FORK_LAUNCHER (`forked_subprocess`)."""
    if command[1:3] != ["-m", "nanotron.train"]:
        raise ValueError(f"not a training command: {command}")
    args, nproc = command[3:], 1
    if "--nproc_per_node" in args:
        at = args.index("--nproc_per_node")
        args, nproc = args[:at] + args[at + 2 :], int(args[at + 1])
    with ForkedRun(lambda: _run_training(nproc, args), command, stdout=stdout, stderr=stderr) as proc:
        proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode)


# A stand-in for the `subprocess` module of package code whose only use of it is `run` of training commands.
forked_subprocess = types.SimpleNamespace(run=run_train_command, STDOUT=subprocess.STDOUT)


def _as_fresh_process() -> None:
    """A forked child's signal handlers and random state as a fresh interpreter's, not the benchmark's."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    random.seed()


def run_code(code: str) -> None:
    """`python -c CODE` in a forked child: its exit code as the interpreter's (sys.exit's, 1 for an exception)."""
    from nanotron.errors import exit_status

    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as done:
        status = exit_status(done)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run_training(nproc: int, args: list[str]) -> None:
    """`nanotron.train`'s main (one process) or the FORK_LAUNCHER module's `main(nproc, args)`, which forks the
    ranks with torchrun's environment."""
    import importlib.util

    from nanotron.errors import run_as_main

    if nproc == 1:
        from nanotron.commands.train import main

        sys.argv = ["nanotron.train", *args]
        run_as_main(main)
    path = os.environ[FORK_LAUNCHER]
    spec = importlib.util.spec_from_file_location("forkrun", path)
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    sys.argv = [path, str(nproc), *args]
    run_as_main(lambda: launcher.main(nproc, args))


def collect_metrics(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 900) -> list[dict]:
    """Waits for a launched run; its step records, or the command and its output if it failed.

    A run that logged all `steps` steps and then exited non-zero (a crash while shutting down) still
    measured every step: its records are kept and the exit is reported, not hidden.
    """
    stdout, stderr = proc.communicate(timeout=timeout)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    records = [r for r in map(json.loads, lines) if "step_time_sec" in r]
    if proc.returncode != 0:
        message = f"run exited {proc.returncode}: {' '.join(proc.args)}"
        if len(records) < steps:
            raise RuntimeError(f"{message}\n{stdout[-2000:]}\n{stderr[-4000:]}")
        last_error = next(
            (line for line in reversed(stderr.splitlines()) if "terminate" in line or "Error" in line), ""
        )
        print(
            f"warning: {message} after logging all {steps} steps; kept its metrics ({last_error.strip()})",
            file=sys.stderr,
            flush=True,
        )
    return records


def run_nanotron(name: str, args: Sequence[str], nproc: int, work_dir: Path, steps: int) -> list[dict]:
    """One fresh training run, start to end: its step records."""
    return collect_metrics(*launch_nanotron(name, args, nproc, work_dir), steps)


def median_after_warmup(values: Sequence[float], warmup: int) -> float:
    """The first steps pay for allocator growth, lazy init and caches: they are not the steady state."""
    steady = list(values[warmup:]) or list(values)
    return statistics.median(steady)


def write_csv(rows: list[dict], path: Path, columns: Sequence[str] | None = None) -> None:
    """Every row, in `columns` (default: the first row's keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns or rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_table(rows: list[dict], columns: Sequence[str], stem: Path) -> str:
    """`<stem>.csv` (every column) and `<stem>.md` (a markdown table); returns the markdown."""
    write_csv(rows, stem.with_suffix(".csv"), columns)
    markdown = markdown_table(rows, columns)
    stem.with_suffix(".md").write_text(markdown + "\n")
    return markdown


def markdown_table(rows: list[dict], columns: Sequence[str]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


@functools.cache
def source_digest() -> str:
    """A hash of the code a run's result depends on (nanotron's sources and the in-process runner), taken once:
    at the sweep's start, when its processes import that code (an edit during the sweep does not relabel it)."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "nanotron").rglob("*.py")) + [REPO / "benchmarks" / "inprocess.py"]:
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class RunCache:
    """--resume: finished runs' rows in a JSON-lines file, each under the key a benchmark derives from the run's
    settings (and, where it says so, its code), so a sweep stopped part-way reruns only what is missing."""

    def __init__(self, path: Path, resume: bool, key: Callable[[tuple], str]):
        self.path, self.resume, self.key = path, resume, key
        self.rows: dict[str, dict] = {}
        if resume and path.exists():
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                self.rows[entry["key"]] = entry["row"]

    def get(self, point: tuple) -> dict | None:
        return self.rows.get(self.key(point)) if self.resume else None

    def put(self, point: tuple, row: dict) -> None:
        if self.resume:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": self.key(point), "row": row}) + "\n")
