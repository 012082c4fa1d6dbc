"""The data pipeline against issue 10's targets: tokenize throughput, loader start-up at 1e9 samples, per-step
data time, blend proportions.

    python -m benchmarks.data [--rounds 3] [--quick] [--out benchmarks/results] [--work-dir .cache/benchmarks]

- tokenize: the same texts (the demo Shakespeare corpus, 8 copies, when `make data` has run; else the synthetic
  corpus) through `nanotron tokenize` with --workers 1 and 2, next to the ceiling: `tokenizers`' own
  encode_batch over the same paragraph pieces, in one process on one core, texts already in memory, nothing
  written. The rayon-threaded encode_batch (all cores) is shown too, and the fixed cost of starting the 2 worker
  processes (spawn, imports, tokenizer), included in the --workers 2 time. Best of --rounds; every round is listed.
- loader at 1e9 samples: a tokenized dir of sparse shards (seq_len 128: 1.3e11 tokens, 256 GB apparent, nothing on
  disk) and its meta.json; a fresh process times open_corpus + build_train_loader + the first microbatch, and
  its RSS growth; then the same at a resume point near the end.
- per-step data time: one step of configs/tiny.toml (global batch 16 x 128, 4 microbatches) drawn from the loader,
  next to the tiny model's step time (median of a 1-process `nanotron.train` run of configs/tiny.toml).
- blend: each dataset's share of the first 10 000 global samples against its weight.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import DEFAULT_WORK_DIR, REPO, RESULTS_DIR, bench_env, bench_parser, synthetic_data, write_table

COLUMNS = ("measurement", "value", "ratio", "target", "met", "detail")
DEMO_CORPUS, DEMO_TOKENIZER = REPO / "data/corpus/shakespeare.jsonl", REPO / "data/tokenizer"
SEQ_LEN = 128


def corpus_for(work_dir: Path, quick: bool) -> tuple[Path, Path, str]:
    """(jsonl corpus, tokenizer, what it is): the demo plays x8 when present, else the synthetic corpus."""
    if not quick and DEMO_CORPUS.is_file() and (DEMO_TOKENIZER / "tokenizer.json").is_file():
        out = work_dir / "data" / "shakespeare_x8.jsonl"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(DEMO_CORPUS.read_text() * 8)
        return out, DEMO_TOKENIZER, "Shakespeare x8"
    return *synthetic_data(work_dir), "synthetic"


def tokenize_rows(corpus: Path, tokenizer_path: Path, work_dir: Path, rounds: int, what: str) -> list[dict]:
    import numpy as np
    import tokenizers

    from nanotron.tokenize.encode import _PARAGRAPH, encode_batches
    from nanotron.tokenize.sources import resolve_sources
    from nanotron.tokenize.tokenizer import load_tokenizer
    from nanotron.tokenize.writer import tokenize

    tokenizer = load_tokenizer(tokenizer_path)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip()]
    pieces = [piece for text in texts for piece in _PARAGRAPH.split(text)]
    megabytes = corpus.stat().st_size / 1e6

    def ceiling(threads: str) -> tuple[float, int]:
        os.environ["TOKENIZERS_PARALLELISM"] = threads
        backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        started, cpu = time.perf_counter(), time.process_time()
        count = sum(len(e.ids) for e in backend.encode_batch(pieces, add_special_tokens=False))
        cpu_seconds[threads].append(time.process_time() - cpu)
        return time.perf_counter() - started, count

    def run(workers: int) -> tuple[float, int]:
        out = work_dir / "tokenized" / f"bench-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        started, cpu = time.perf_counter(), time.process_time()
        meta, _ = tokenize(resolve_sources([str(corpus)]), tokenizer, out, workers=workers, progress=False)
        seconds = time.perf_counter() - started
        cpu_seconds[str(workers)].append(time.process_time() - cpu)  # this process only: all of it for 1 worker
        shutil.rmtree(out)
        return seconds, sum(meta["tokens"].values())

    def pool_start() -> float:
        started = time.perf_counter()
        list(encode_batches(iter([["warm up"]] * 4), tokenizer, np.dtype("<u2"), 2))
        return time.perf_counter() - started

    timed: dict[str, list[tuple[float, int]]] = {"ceiling": [], "threads": [], "1": [], "2": []}
    cpu_seconds: dict[str, list[float]] = {"false": [], "true": [], "1": [], "2": []}
    starts = []
    for _ in range(rounds):  # interleaved, so a noisy moment hits every variant alike
        timed["ceiling"].append(ceiling("false"))
        timed["threads"].append(ceiling("true"))
        timed["1"].append(run(1))
        timed["2"].append(run(2))
        starts.append(pool_start())
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    rate = {name: max(tokens / seconds for seconds, tokens in runs) for name, runs in timed.items()}
    every = {name: " ".join(f"{tokens / s / 1e6:.3f}" for s, tokens in runs) for name, runs in timed.items()}
    detail = f"{what}, {megabytes:.1f} MB, {timed['1'][0][1] / 1e6:.2f}M tokens; M tokens/s per round: "
    one, two = rate["1"] / rate["ceiling"], rate["2"] / rate["1"]
    cpu_ratio = min(cpu_seconds["false"]) / min(cpu_seconds["1"])  # CPU seconds: what other load can't inflate
    return [
        row("tokenize ceiling: encode_batch, 1 core", rate["ceiling"], "", "", "", detail + every["ceiling"]),
        row("encode_batch, rayon threads (all cores)", rate["threads"], "", "", "", detail + every["threads"]),
        row(
            "nanotron tokenize --workers 1",
            rate["1"],
            f"{one:.2f}x ceiling",
            ">= 0.8x ceiling",
            one >= 0.8,
            f"{every['1']}; by CPU time {cpu_ratio:.2f}x ceiling",
        ),
        row(
            "nanotron tokenize --workers 2",
            rate["2"],
            f"{two:.2f}x 1 worker",
            ">= 1.7x 1 worker",
            two >= 1.7,
            every["2"],
        ),
        row(
            "start of the 2 worker processes",
            f"{min(starts):.2f} s",
            "",
            "",
            "",
            "spawn + imports + tokenizer, once per run; per round: " + " ".join(f"{t:.2f}" for t in starts),
        ),
    ]


def row(measurement: str, value: object, ratio: str, target: str, met: object, detail: str = "") -> dict:
    shown = f"{value / 1e6:.3f}M tokens/s" if isinstance(value, float) and value > 1000 else value
    met = met if isinstance(met, str) else ("yes" if met else "NO")
    return {"measurement": measurement, "value": shown, "ratio": ratio, "target": target, "met": met, "detail": detail}


def sparse_dir(root: Path, samples: int, tokenizer_path: Path, shards: int) -> Path:
    """A tokenized dir whose train split holds `samples` samples of SEQ_LEN + 1 tokens in sparse files (zeros)."""
    from nanotron.tokenize.format import FORMAT, VERSION, shard_name
    from nanotron.tokenize.tokenizer import load_tokenizer

    out = root / f"sparse-{samples:.0e}-{tokenizer_path.name}"
    if (out / "meta.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_path)
    total, val = samples * SEQ_LEN + 1, 10_000 * SEQ_LEN + 1
    per_shard, records = -(-total // shards), []
    for index in range(shards):
        tokens = {"train": min(per_shard, total - index * per_shard), "val": val if index == 0 else 0}
        files = {}
        for split, count in tokens.items():
            for kind, size in (("bin", 2 * count), ("idx", 8 if count else 0)):
                name = shard_name(split, index, kind)
                with open(out / name, "wb") as f:
                    f.truncate(size)  # sparse: no block is written
                files[name] = {"bytes": size, "sha256": "not computed (sparse benchmark file)"}
        split_documents = {split: int(count > 0) for split, count in tokens.items()}
        records.append({"first_document": index, "documents": 1, "split_documents": split_documents})
        records[-1] |= {"tokens": tokens, "files": files}
    meta = {"format": FORMAT, "version": VERSION, "dtype": "uint16", "eos_id": tokenizer.eos_id}
    meta |= {"vocab_size": tokenizer.vocab_size, "tokenizer": {"fingerprint": tokenizer.fingerprint, "path": "bench"}}
    documents = {split: sum(r["split_documents"][split] for r in records) for split in ("train", "val")}
    totals = {split: sum(r["tokens"][split] for r in records) for split in ("train", "val")}
    meta |= {"documents": documents, "tokens": totals, "shards": records}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


LOADER_PROBE = """
import json, sys, time
def rss_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
from nanotron.config import load_config
from nanotron.data import open_corpus
from nanotron.data.loader import build_train_loader
path, tokenizer, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = load_config("configs/tiny.toml", [("data.path", path), ("data.tokenizer", tokenizer)])
before = rss_mb()
started = time.perf_counter()
corpus = open_corpus(cfg)
loader = iter(build_train_loader(corpus, cfg.training, seed=0, dp=1, dp_rank=0, start_sample=start))
first = next(loader)
startup = time.perf_counter() - started
after = rss_mb()
steps, accum = 200, cfg.training.grad_accum_steps
started = time.perf_counter()
for _ in range(steps * accum):
    next(loader)
step = (time.perf_counter() - started) / steps
print(json.dumps({"samples": corpus.num_train_samples, "startup_s": startup, "extra_rss_mb": after - before,
                  "step_data_s": step, "shape": list(first.shape)}))
"""


def probe_loader(path: Path, tokenizer: Path, start: int) -> dict:
    """Start-up, RSS growth and per-step data time of a fresh process's loader at global sample `start`."""
    cmd = [sys.executable, "-c", LOADER_PROBE, str(path), str(tokenizer), str(start)]
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"loader probe failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tiny_step_seconds(data_dir: Path, tokenizer: Path, work_dir: Path, steps: int) -> float:
    """Median step time (after 3 warm-up steps) of configs/tiny.toml in one process, from its metrics.jsonl."""
    run_dir = work_dir / "runs" / "data-tiny"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["--config", "configs/tiny.toml", f"--data.path={data_dir}", f"--data.tokenizer={tokenizer}"]
    args += [f"--job.out_dir={run_dir.parent}", f"--job.name={run_dir.name}", f"--training.steps={steps}"]
    args += ["--training.eval_interval=0", "--checkpoint.save_final=false", "--checkpoint.interval=0"]
    args += ["--checkpoint.resume_from=none", "--logging.log_interval=1", "--logging.tensorboard=false"]
    cmd = [sys.executable, "-m", "nanotron.train", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"tiny run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median([r["step_time_sec"] for r in records if "step_time_sec" in r][3:])


def loader_rows(work_dir: Path, tokenizer: Path, quick: bool) -> list[dict]:
    big = sparse_dir(work_dir / "tokenized", 10**9, tokenizer, shards=64)
    small = sparse_dir(work_dir / "tokenized", 10**6, tokenizer, shards=1)
    fresh, resumed, reference = (
        probe_loader(big, tokenizer, 0),
        probe_loader(big, tokenizer, 10**9 - 10**4),
        probe_loader(small, tokenizer, 0),
    )
    step = tiny_step_seconds(big, tokenizer, work_dir, steps=8 if quick else 30)
    share = fresh["step_data_s"] / step
    sizes = f"{fresh['samples']:.3g} samples in 64 sparse shards (256 GB apparent)"
    return [
        row(
            "loader start-up, 1e9 samples", f"{fresh['startup_s']:.3f} s", "", "<= 1 s", fresh["startup_s"] <= 1, sizes
        ),
        row(
            "loader extra RSS, 1e9 samples",
            f"{fresh['extra_rss_mb']:.1f} MB",
            "",
            "<= 100 MB",
            fresh["extra_rss_mb"] <= 100,
            "open_corpus + build_train_loader + first microbatch",
        ),
        row(
            "resume at sample 999,990,000",
            f"{resumed['startup_s']:.3f} s",
            "",
            "",
            "",
            f"extra RSS {resumed['extra_rss_mb']:.1f} MB",
        ),
        row(
            "same, 1e6 samples (1 shard)",
            f"{reference['startup_s']:.3f} s",
            "",
            "",
            "",
            f"extra RSS {reference['extra_rss_mb']:.1f} MB: start-up does not grow with the corpus",
        ),
        row(
            "data time per tiny step (16 x 129 tokens)",
            f"{fresh['step_data_s'] * 1e3:.2f} ms",
            f"{share:.2%} of the step",
            "<= 1% of the step",
            share <= 0.01,
            f"tiny model step {step * 1e3:.0f} ms (1 process, median)",
        ),
    ]


def blend_rows(work_dir: Path, tokenizer: Path) -> list[dict]:
    from nanotron.config import load_config
    from nanotron.data import open_corpus
    from nanotron.data.loader import TrainSamples

    parts = [sparse_dir(work_dir / "tokenized" / f"blend{i}", 10**6, tokenizer, shards=1) for i in range(3)]
    rows = []
    for weights in ([0.5, 0.3, 0.2], [0.7, 0.2, 0.1], [0.98, 0.01, 0.01]):
        entries = ",".join(f"{p}:{w}" for p, w in zip(parts, weights))
        cfg = load_config("configs/tiny.toml", [("data.datasets", entries), ("data.tokenizer", str(tokenizer))])
        samples = TrainSamples(open_corpus(cfg), seed=0)
        counts = [0] * len(weights)
        for g in range(10_000):
            counts[samples.locate(g)[0]] += 1
        errors = [abs(c / 10_000 - w) / w for c, w in zip(counts, weights)]
        detail = "observed " + " / ".join(f"{c / 10_000:.4f}" for c in counts)
        rows.append(
            row(
                f"blend {'/'.join(map(str, weights))}, 10 000 samples",
                f"max error {max(errors):.3%}",
                "of each weight",
                "<= 1%",
                max(errors) <= 0.01,
                detail,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("data", __doc__)
    parser.add_argument("--rounds", type=int, default=3, help="tokenize rounds; the best is kept (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke test: synthetic corpus, one round, short run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for data.csv/.md")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="corpora, sparse dirs and runs")
    args = parser.parse_args(argv)
    corpus, tokenizer, what = corpus_for(args.work_dir, args.quick)
    rows = tokenize_rows(corpus, tokenizer, args.work_dir, 1 if args.quick else args.rounds, what)
    rows += loader_rows(args.work_dir, tokenizer, args.quick)
    rows += blend_rows(args.work_dir, tokenizer)
    print(write_table(rows, COLUMNS, args.out / "data"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
