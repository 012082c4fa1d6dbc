"""Every checkpoint file carries a checksum, verified before anything is read; an untrusted index's tensor
sizes are checked against the model config before anything is allocated."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_MODEL, ZYGOTE, Box, run_train, train_env

from nanotron.checkpoint.integrity import CHECKSUM_FILE
from nanotron.checkpoint.manager import CheckpointManager
from nanotron.checkpoint.safe_io import read_metadata
from nanotron.config import CheckpointConfig
from nanotron.errors import CheckpointError


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
    """`python -m MODULE ARGS` from the repository root, forked from the worker's tests/zygote.py."""
    return ZYGOTE.run([sys.executable, "-m", module, *args], list(args), 1, REPO, train_env(), 120, module=module)


def flip_a_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.mark.slow
def test_every_file_of_a_checkpoint_has_a_checksum(saved):
    _, step = saved
    sums = json.loads((step / CHECKSUM_FILE).read_text())
    files = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()}
    assert files - set(sums) == {CHECKSUM_FILE}  # the commit marker (trainer_state.json) included
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


# ---- the manifest lists exactly the files of a checkpoint ----------------------------------------------


def save_one(folder: Path) -> Path:
    """A checkpoint of a small model and progress, saved by the manager in this process."""
    CheckpointManager(folder, CheckpointConfig(), {"model": Box(w=torch.arange(256.0))}, Box(step=1)).save(1)
    return folder / "step-1"


def load_progress(step: Path, **options) -> dict:
    progress = Box(step=0)
    manager = CheckpointManager(step.parent, CheckpointConfig(**options), {"model": Box(w=torch.zeros(256))}, progress)
    manager.load(step)
    return progress.state


def test_a_manifest_that_leaves_out_a_file_or_a_file_it_does_not_list_is_refused(tmp_path):
    """An empty checksums.json, one without a shard's entry (then rotted) or a file added beside the checkpoint's
    are refused in one line naming the file; checkpoint.allow_unverified reads the unlisted files unchecked."""
    step = save_one(tmp_path)
    manifest = step / CHECKSUM_FILE
    sums = json.loads(manifest.read_text())
    assert set(sums) == {".metadata", "__0_0.distcp", "trainer_state.json"}
    manifest.write_text("{}")
    with pytest.raises(CheckpointError, match=re.escape(f"'{step / '.metadata'}' is not in its manifest")):
        load_progress(step)
    shard = step / "__0_0.distcp"
    manifest.write_text(json.dumps({name: value for name, value in sums.items() if name != shard.name}))
    flip_a_bit(shard)
    with pytest.raises(CheckpointError, match=re.escape(f"'{shard}' is not in its manifest '{manifest}'")):
        load_progress(step)
    assert load_progress(step, allow_unverified=True)["step"] == 1  # asked for: read unchecked
    flip_a_bit(shard)
    manifest.write_text(json.dumps(sums))
    (step / "notes.txt").write_text("a file the save did not write")
    with pytest.raises(CheckpointError, match=re.escape(f"'{step / 'notes.txt'}' is not in its manifest")):
        load_progress(step)
    (step / "notes.txt").unlink()
    manifest.write_text(json.dumps(sums | {"gone.bin": sums[shard.name]}))
    with pytest.raises(CheckpointError, match=re.escape(f"'{step / 'gone.bin'}' is missing")):
        load_progress(step)


def test_an_edited_or_rotted_trainer_state_is_refused_by_its_checksum(tmp_path):
    step = save_one(tmp_path)
    state = step / "trainer_state.json"
    state.write_text(state.read_text().replace('"step": 1', '"step": 7'))
    with pytest.raises(CheckpointError, match=re.escape(f"'{state}' is corrupt")):
        load_progress(step)
