"""ZeRO stages keep their memory promise (DESIGN contract 11), measured in real training processes by
`benchmarks/probe.py`: what a rank holds between microbatches, not only after the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY_MODEL, train_env, train_losses

# Global batch 16 of one sample: 16 microbatches in one process, 8 per rank at dp=2 (the case).
EIGHT_MICROBATCHES = ["--training.micro_batch_size=1", "--training.global_batch_size=16", "--training.steps=2"]


def measure(tiny_data, out: Path, name: str, nproc: int, extra: list[str]) -> tuple[list[dict], list[float]]:
    """Per-rank records of benchmarks.memory's worker (the real Trainer under the probe) and the losses."""
    record = out / f"{name}.json"
    args = [
        "-m",
        "benchmarks.memory",
        "--worker",
        "--out",
        str(record),
        *TINY_MODEL,
        *tiny_data.overrides(),
        *EIGHT_MICROBATCHES,
        f"--job.out_dir={out}",
        f"--job.name={name}",
        "--checkpoint.save_final=false",
        *extra,
    ]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    proc = subprocess.run(
        [sys.executable, *launcher, *args], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(record.read_text()), train_losses(out / name)


@pytest.fixture(scope="module")
def one_process(tiny_data, tmp_path_factory) -> tuple[list[dict], list[float]]:
    return measure(tiny_data, tmp_path_factory.mktemp("one"), "one", 1, [])


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_2_and_3_hold_only_gradient_shards_across_eight_microbatches(zero_stage, one_process, tiny_data, tmp_path):
    (reference,), ref_losses = one_process
    ranks, losses = measure(
        tiny_data, tmp_path, "dp2", 2, ["--parallelism.dp=2", f"--parallelism.zero_stage={zero_stage}"]
    )
    held = [r["grad_bytes"] for r in ranks]
    print(f"zero {zero_stage}: gradient bytes held per rank {held} vs one process {reference['grad_bytes']}")
    assert max(held) <= 0.55 * reference["grad_bytes"], (held, reference["grad_bytes"])
    assert len(losses) == len(ref_losses) == 2
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
