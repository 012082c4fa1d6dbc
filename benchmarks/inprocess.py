"""Many short single-process training runs inside this Python process (the µP benchmarks' sweeps).

A fresh `python -m nanotron.train` costs seconds of start-up (imports, process group); a sweep of ~100 runs of
a few seconds each would spend most of its time there. Each run here is the real Trainer on a world of one,
torn down after it as the command line does, so every run starts from the same clean state.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

from benchmarks.common import NO_OUTPUTS, REPO, data_overrides, ensure_data

SHAKESPEARE = REPO / "data" / "corpus" / "shakespeare.jsonl"

# Every sweep run: one process on the CPU, no checkpoints or TensorBoard.
SWEEP_RUN = [
    *NO_OUTPUTS,
    "--training.device=cpu",
    "--logging.peak_tflops=1",
    "--training.max_skipped_steps=0",
]


def corpus_overrides(work_dir: Path, quick: bool, vocab_size: int = 1024) -> list[str]:
    """`--data.*` overrides: the synthetic corpus for --quick, else the Shakespeare plays from `make data` with
    their own small BPE (vocab 1024 keeps the embedding and head small next to the layers being scaled)."""
    if quick:
        return ensure_data(work_dir)
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"error: {SHAKESPEARE} not found; run `make data` first (or pass --quick)")
    from nanotron.data.demo import read_jsonl_texts
    from nanotron.tokenize.bpe import train_tokenizer

    tokenizer = work_dir / "shakespeare" / f"tokenizer-{vocab_size}"
    if not (tokenizer / "tokenizer.json").is_file():
        train_tokenizer(read_jsonl_texts(SHAKESPEARE), tokenizer, vocab_size=vocab_size)
    return data_overrides(SHAKESPEARE, tokenizer, work_dir / "shakespeare" / f"tokens-{vocab_size}")


def train_run(name: str, args: list[str], work_dir: Path) -> tuple[list[dict], bool]:
    """Trains one run in this process; its metrics.jsonl records, and False if it diverged (stopped at a
    non-finite loss or gradient: the records until then are kept). The trainer's output goes to train.log. A run
    that ends early otherwise (a stop signal: the trainer saves and returns) raises: its loss is no result."""
    from nanotron.config import load_config, parse_overrides
    from nanotron.errors import DivergenceError
    from nanotron.parallel.mesh import destroy_distributed
    from nanotron.trainer import Trainer

    run_dir = work_dir / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = load_config(*parse_overrides([*SWEEP_RUN, *args, f"--job.out_dir={run_dir.parent}", f"--job.name={name}"]))
    finished = True
    with open(run_dir / "train.log", "w") as log, contextlib.redirect_stdout(log):
        trainer = Trainer(cfg)
        try:
            trainer.train()
        except DivergenceError as error:
            print(f"diverged: {error}")
            finished = False
        finally:
            trainer.close()
            destroy_distributed()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = max((r["step"] for r in records if "loss" in r), default=0)
    if finished and last < cfg.training.steps:  # a stop signal: the trainer saved and returned early
        raise RuntimeError(f"{name}: stopped at step {last} of {cfg.training.steps} without diverging: not a result")
    return records, finished


def late_train_loss(records: list[dict], finished: bool, fraction: float = 0.2) -> float:
    """Mean training loss over the last `fraction` of the steps; inf for a run that diverged.

    In a run shorter than one pass over the data every batch is new to the model when its loss is taken, so
    this is a held-out estimate, over far more tokens than an evaluation pass of the same cost."""
    losses = [r["loss"] for r in records if "loss" in r]
    tail = losses[-max(1, round(fraction * len(losses))) :]
    if not finished or not tail or not all(math.isfinite(x) for x in tail):
        return math.inf
    return sum(tail) / len(tail)


def family_overrides(width: int, depth: int, heads: int = 4, mlp_ratio: int = 4, kv_heads: int = 0) -> list[str]:
    """One member of a model family that grows in width and depth (`heads` per model; `kv_heads`: 0 = heads)."""
    return [
        f"--model.hidden_size={width}",
        f"--model.intermediate_size={mlp_ratio * width}",
        f"--model.num_layers={depth}",
        f"--model.num_heads={heads}",
        f"--model.num_kv_heads={kv_heads or heads}",
    ]
