"""Every checkpoint file carries a checksum, verified before anything is read; an untrusted index's tensor
sizes are checked against the model config before anything is allocated."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY_MODEL, run_train, train_env

from nanotron.checkpoint.integrity import CHECKSUM_FILE
from nanotron.checkpoint.safe_io import read_metadata


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    common = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={root}", "--training.steps=2"]
    run_train([*common, "--job.name=base", "--parallelism.dp=2"], nproc=2)
    return common, root / "base" / "checkpoints" / "step-2"


def one_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def command(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120
    )


def flip_a_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.mark.slow
def test_every_file_of_a_checkpoint_has_a_checksum(saved):
    _, step = saved
    sums = json.loads((step / CHECKSUM_FILE).read_text())
    files = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()}
    assert files - set(sums) == {CHECKSUM_FILE, "trainer_state.json"}  # the commit marker is written after it
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "config.toml", "tokenizer/tokenizer.json"} <= set(sums)


@pytest.mark.slow
def test_same_size_bit_rot_is_a_one_line_error_for_resume_export_and_generate(saved, tmp_path):
    common, good = saved
    step = tmp_path / "step-2"
    shutil.copytree(good, step)
    shard = step / "__1_0.distcp"
    flip_a_bit(shard)
    expected = f"'{shard}' is corrupt (its xxh3_128x16m checksum differs from the one saved with it)"
    resume = [*common, f"--job.out_dir={tmp_path}", "--job.name=resumed", f"--checkpoint.resume_from={step}"]
    proc = run_train([*resume, "--parallelism.dp=2", "--nproc_per_node=2"], check=False)
    assert expected in one_error(proc)  # found by whichever rank hashed that shard, printed once
    assert expected in one_error(command("nanotron", "convert", "to-hf", str(step), str(tmp_path / "hf")))
    assert expected in one_error(command("nanotron", "generate", "--checkpoint", str(step), "--prompt", "the"))
    config = step / "tokenizer" / "tokenizer.json"
    shutil.copyfile(good / "__1_0.distcp", shard)
    flip_a_bit(config)
    assert f"'{config}' is corrupt" in one_error(
        command("nanotron", "convert", "to-hf", str(step), str(tmp_path / "x"))
    )


@pytest.mark.slow
def test_an_index_claiming_a_huge_tensor_is_refused_before_any_allocation(saved, tmp_path):
    _, good = saved
    step = tmp_path / "step-2"
    shutil.copytree(good, step)
    metadata = read_metadata(step)
    metadata.state_dict_metadata["model.lm_head.weight"].size = (2**20, 2**20)  # 4 TiB of fp32
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    (step / CHECKSUM_FILE).unlink()  # an index from elsewhere, without checksums (read unchecked on request)
    for proc in (
        command("nanotron", "convert", "to-hf", str(step), str(tmp_path / "hf"), "--allow_unverified"),
        command("nanotron", "generate", "--checkpoint", str(step), "--prompt", "the", "--allow_unverified"),
    ):
        assert "lm_head.weight has shape [1048576, 1048576], but its config.toml says [512, 32]" in one_error(proc)


@pytest.mark.slow
def test_a_checkpoint_whose_checksums_were_deleted_is_refused_unless_allowed(saved, tmp_path):
    """Integrity cannot be switched off by deleting checksums.json: resume, export and generate refuse in one
    line naming the file and the override; with the override each reads it (a hand-made or pre-checksum one)."""
    common, good = saved
    step = tmp_path / "step-2"
    shutil.copytree(good, step)
    (step / CHECKSUM_FILE).unlink()
    expected = f"'{step / CHECKSUM_FILE}' is missing, so the checkpoint's files cannot be checked for corruption"
    resume = [*common, f"--job.out_dir={tmp_path}", f"--checkpoint.resume_from={step}", "--training.steps=3"]
    assert expected in one_error(run_train([*resume, "--job.name=refused"], check=False))
    assert expected in one_error(command("nanotron", "convert", "to-hf", str(step), str(tmp_path / "hf")))
    assert expected in one_error(command("nanotron", "generate", "--checkpoint", str(step), "--prompt", "the"))
    run_train([*resume, "--job.name=allowed", "--checkpoint.allow_unverified=true"])
    proc = command("nanotron", "convert", "to-hf", str(step), str(tmp_path / "hf"), "--allow_unverified")
    assert proc.returncode == 0, proc.stderr
    proc = command("nanotron", "generate", "--checkpoint", str(step), "--prompt", "the", "--allow_unverified")
    assert proc.returncode == 0, proc.stderr
