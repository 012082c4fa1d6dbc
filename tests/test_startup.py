"""Fast (re)starts: a start that loads a checkpoint never draws the random init it would overwrite."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL, run_train, train_losses
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import nanotron.parallel.parallelize
import nanotron.train


def model_weights(step_dir) -> dict[str, torch.Tensor]:
    target = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, target)
    return torch.load(target, weights_only=True)["model"]


@pytest.mark.slow
def test_resume_skips_the_random_init_and_still_resumes_bit_exact(tiny_data, tmp_path, monkeypatch, capsys):
    common = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--training.steps=4"]
    run_train([*common, "--job.name=fresh", "--checkpoint.interval=2"])
    fresh = tmp_path / "fresh"

    def no_init(*args, **kwargs):
        raise AssertionError("the random init ran although a checkpoint overwrites it")

    monkeypatch.setattr(nanotron.parallel.parallelize, "init_weights", no_init)
    step2 = fresh / "checkpoints" / "step-2"
    # One intra-op thread, as the forked run had (OMP_NUM_THREADS=1): a BLAS may split a matmul's sums by
    # thread (MKL's AVX2 kernels do: the last bits then differ), and bit-exact holds for the same settings.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = nanotron.train.main([*common, "--job.name=resumed", f"--checkpoint.resume_from={step2}"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    resumed = tmp_path / "resumed"
    assert train_losses(resumed) == train_losses(fresh)[2:]  # bit-exact, not approximately
    final, expected = model_weights(resumed / "checkpoints" / "step-4"), model_weights(fresh / "checkpoints" / "step-4")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    assert "random init skipped" in capsys.readouterr().out
