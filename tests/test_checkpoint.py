"""Checkpoints: exact resume, preemption, kills at random moments, untrusted/corrupt files (resume at another
layout: test_parallel.py and test_mup.py)."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    TINY_MODEL,
    Box,
    console_messages,
    popen_train,
    read_metrics,
    run_train,
    shapes_of,
    train_losses,
    wait_for_training,
    worker_pids,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager

from nanotron.checkpoint import layout
from nanotron.checkpoint.layout import committed_steps, latest_checkpoint
from nanotron.checkpoint.manager import CheckpointManager, resolve_source
from nanotron.checkpoint.safe_io import dcp_errors, load_dcp, read_metadata, read_model_weights, verified_checkpoint
from nanotron.checkpoint.torch_private import stager_keeps_its_buffers
from nanotron.config import CheckpointConfig, load_config, parse_overrides
from nanotron.errors import CheckpointError
from nanotron.optim import lr_at
from nanotron.parallel.layout import layout_sizes
from nanotron.records import TRAINER_STATE
from nanotron.stability import Stability
from nanotron.trainer import Progress, TrainState

STEPS = 30  # long enough that interruptions land mid-run; every 1-process test shares this reference


def args_for(tiny_data, tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [
        *tiny_data.overrides(),
        *TINY_MODEL,
        f"--job.out_dir={tmp_path}",
        f"--job.name={name}",
        f"--training.steps={STEPS}",
        "--checkpoint.save_final=false",
        *extra,
    ]


def losses_by_step(run_dir: Path) -> dict[int, list[float]]:
    """Every logged loss per step, across all the (re)starts that appended to metrics.jsonl."""
    out: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by SIGKILL
            continue
        if "loss" in record:
            out.setdefault(record["step"], []).append(record["loss"])
    return out


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> list[float]:
    """Losses of one uninterrupted 1-process run that saves nothing."""
    root = tmp_path_factory.mktemp("reference")
    run_train(args_for(tiny_data, root, "ref", "--checkpoint.resume_from=none"))
    return train_losses(root / "ref")


@pytest.fixture(scope="module")
def saved_run(tiny_data, tmp_path_factory) -> tuple[Path, list[float]]:
    """The same run saving step 0 and every 10 steps with async_mode=async: its checkpoint folder and losses."""
    root = tmp_path_factory.mktemp("saved")
    run_train(
        args_for(
            tiny_data,
            root,
            "saved",
            "--checkpoint.interval=10",
            "--checkpoint.save_initial_state=true",
            "--checkpoint.async_mode=async",
            "--checkpoint.save_final=true",
        )
    )
    return root / "saved" / "checkpoints", train_losses(root / "saved")


@pytest.mark.slow
def test_saving_changes_nothing_and_resume_is_bit_exact(tiny_data, tmp_path, reference, saved_run):
    folder, saved_losses = saved_run
    assert saved_losses == reference
    assert [p.name for p in committed_steps(folder)] == ["step-0", "step-10", "step-20", "step-30"]
    assert (folder / "latest").read_text().strip() == "step-30"
    for start in (10, 0):
        name = f"from{start}"
        run_train(args_for(tiny_data, tmp_path, name, f"--checkpoint.resume_from={folder / f'step-{start}'}"))
        assert train_losses(tmp_path / name) == reference[start:], f"resumed from step {start}"
    state = json.loads((folder / "step-10" / "trainer_state.json").read_text())
    assert (state["step"], state["consumed_samples"], state["consumed_tokens"]) == (10, 80, 80 * 16)


@pytest.mark.slow
def test_a_changed_learning_rate_is_honoured_on_resume(tiny_data, tmp_path, saved_run):
    """The schedule is a function of (step, current config): a new optimizer.lr applies from the next step."""
    folder, _ = saved_run
    run_train(
        args_for(
            tiny_data,
            tmp_path,
            "new-lr",
            f"--checkpoint.resume_from={folder / 'step-10'}",
            "--optimizer.lr=1e-3",
            "--optimizer.min_lr=1e-4",
        )
    )
    cfg = load_config(
        *parse_overrides([*TINY_MODEL, "--training.steps=30", "--optimizer.lr=1e-3", "--optimizer.min_lr=1e-4"])
    )
    logged = [r["lr"] for r in read_metrics(tmp_path / "new-lr") if "lr" in r]
    assert logged == pytest.approx([lr_at(step, cfg.optimizer, 30) for step in range(10, 30)], rel=1e-12)


def _kill_mid_save(args: list[str], folder: Path, tries: int = 5) -> list[str]:
    """Kills runs as soon as a step-N.tmp appears until a kill leaves one behind (a save cut short);
    returns the .tmp dirs of that kill. A save can finish between seeing its .tmp and the kill: try again."""
    for _ in range(tries):
        proc = popen_train(args)
        wait_for_training(proc)
        deadline = time.monotonic() + 30
        while not list(folder.glob("step-*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.kill()
        proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, "the run ended before the kill"
        left = sorted(p.name for p in folder.glob("step-*.tmp"))
        if left:
            return left
    raise AssertionError(f"no kill landed mid-save in {tries} tries")


@pytest.mark.slow
def test_killed_at_random_moments_then_resumed_ends_like_an_uninterrupted_run(tiny_data, tmp_path, reference):
    """SIGTERM once (clean stop + checkpoint), then SIGKILL at seeded random moments and once mid-save."""
    args = args_for(tiny_data, tmp_path, "killed", "--checkpoint.interval=1", "--checkpoint.keep_last=2")
    folder = tmp_path / "killed" / "checkpoints"
    rng = random.Random(1234)
    events = []
    for attempt, how in enumerate(["sigterm", "random", "mid-save", "random"]):
        if how == "mid-save":
            events.append((attempt, how, _kill_mid_save(args, folder)))  # fails unless a kill cut a save
        else:
            proc = popen_train(args)
            wait_for_training(proc)
            if how == "sigterm":
                proc.send_signal(signal.SIGTERM)
            else:
                time.sleep(rng.uniform(0.0, 0.25))
                proc.kill()
            output = proc.communicate(timeout=120)[0]
            events.append((attempt, how, proc.returncode))
            if how == "sigterm":
                assert proc.returncode == 0 and "preempted: stopped at step" in output, output[-2000:]
                assert f"saved {latest_checkpoint(folder)}" in output
            else:
                assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill: {events}"
        # What `auto` would pick next is complete and loads.
        latest = latest_checkpoint(folder)
        assert latest is not None and read_model_weights(latest, shapes_of(latest))
    run_train(args)
    logged = losses_by_step(tmp_path / "killed")
    assert sorted(logged) == list(range(1, STEPS + 1)), events
    for step, losses in logged.items():  # steps redone after a kill repeat their losses bit for bit
        assert set(losses) == {reference[step - 1]}, (step, losses, events)
    assert [p.name for p in committed_steps(folder)] == [f"step-{STEPS - 1}", f"step-{STEPS}"]
    assert not list(folder.glob("step-*.tmp")) and not list(folder.glob("step-*.deleting"))


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_every_rank_with_a_checkpoint_and_exit_0(tiny_data, tmp_path):
    args = [
        *tiny_data.overrides(),
        *TINY_MODEL,
        f"--job.out_dir={tmp_path}",
        "--job.name=preempted",
        "--training.steps=5000",
        "--parallelism.dp=2",
        "--nproc_per_node=2",
    ]
    proc = popen_train(args)
    wait_for_training(proc)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGUSR1)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]
    stopped = next(line for line in console_messages(output) if line.startswith("preempted: stopped at step"))
    step = int(stopped.split()[4])
    folder = tmp_path / "preempted" / "checkpoints"
    assert 0 < step < 5000 and latest_checkpoint(folder) == folder / f"step-{step}"
    assert json.loads((folder / f"step-{step}" / "trainer_state.json").read_text())["step"] == step


# ---- corrupt and untrusted files ----------------------------------------------------------------------


@pytest.mark.slow
def test_truncated_shard_is_a_one_line_error_naming_the_file(tiny_data, tmp_path, saved_run):
    step = tmp_path / "step-10"
    shutil.copytree(saved_run[0] / "step-10", step)
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run_train(args_for(tiny_data, tmp_path, "bad", f"--checkpoint.resume_from={step}"), check=False)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and f"'{shard}' is truncated" in errors[0], proc.stderr


@pytest.mark.slow
def test_corrupt_files_are_errors_naming_them(tmp_path, saved_run):
    step = tmp_path / "step-10"
    shutil.copytree(saved_run[0] / "step-10", step)
    metadata = step / ".metadata"
    good = metadata.read_bytes()
    metadata.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=f"'{metadata}' is corrupt"):
        read_metadata(step)
    metadata.write_bytes(good)
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)  # same size, garbage content
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"'{shard}' is corrupt"):
        read_model_weights(verified_checkpoint(step), shapes_of(step))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"'{shard}' is missing"):
        read_model_weights(verified_checkpoint(step), shapes_of(step))


def test_only_failures_a_user_can_fix_become_one_line_errors(tmp_path):
    """Disk and file-format failures are CheckpointErrors naming the path; a programming error (in nanotron or
    torch, bare or wrapped in DCP's per-rank CheckpointException) stays a traceback so it gets reported."""
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"writing '.*__0_0.distcp' failed \(No space left on device\)"):
        with dcp_errors(tmp_path, "save"):
            raise CheckpointException("save", {0: (full, None)})
    with pytest.raises(CheckpointError, match=f"cannot load checkpoint '{tmp_path}': UnpicklingError"):
        with dcp_errors(tmp_path):
            raise pickle.UnpicklingError("invalid load key")
    with pytest.raises(TypeError, match="a bug"):
        with dcp_errors(tmp_path):
            raise TypeError("a bug")
    with pytest.raises(CheckpointException):
        with dcp_errors(tmp_path, "save"):
            raise CheckpointException("save", {1: (KeyError("model.layers.0.mlp"), None)})


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(CheckpointError, match="refusing to load"):
        read_metadata(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_an_index_written_by_any_python_reads_on_this_one(tmp_path, module):
    """DCP's index holds the checkpoint's path, pickled under its class's module: `pathlib` up to Python 3.12,
    `pathlib._local` from 3.13 on. Either must read on any Python (a cluster on 3.13, an eval box on 3.11)."""
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    index = tmp_path / ".metadata"
    with open(index, "rb") as f:
        metadata = pickle.load(f)
    assert isinstance(metadata.storage_meta.checkpoint_id, Path)
    # Protocol 2 names classes in text ("c<module>\n<name>\n"), so the module can be renamed in place.
    written = pickle.dumps(Path(), protocol=2).split(b"\n")[0][len(b"\x80\x02c") :]  # this Python's module
    pickled = pickle.dumps(metadata, protocol=2)
    index.write_bytes(pickled.replace(b"c" + written + b"\nPosixPath\n", f"c{module}\nPosixPath\n".encode()))
    assert f"c{module}\nPosixPath\n".encode() in index.read_bytes()
    assert read_metadata(tmp_path).storage_meta.checkpoint_id == tmp_path


@pytest.mark.slow
def test_non_tensor_values_are_loaded_weights_only(tmp_path, saved_run):
    """Optimizer hyper-parameters travel as torch.save'd bytes: a pickled object among them is refused."""
    step = tmp_path / "step-10"
    shutil.copytree(saved_run[0] / "step-10", step)
    metadata = read_metadata(step)
    key = next(k for k in metadata.state_dict_metadata if k.startswith("optimizer.param_groups") and k.endswith(".lr"))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    shard = step / metadata.storage_data[index].relative_path
    payload = io.BytesIO()
    torch.save(_Exploit(tmp_path / "pwned"), payload)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:  # an attacker's file: the value's bytes and the index both rewritten
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], offset=offset, length=len(payload.getvalue())
    )
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=f"'{shard}' is corrupt"):
        load_dcp(step, {"optimizer": {key.removeprefix("optimizer."): 0.0}})
    assert not (tmp_path / "pwned").exists()


# ---- which checkpoint `auto` picks --------------------------------------------------------------------


def _fake_step(folder: Path, step: int, committed: bool = True, tmp: bool = False) -> Path:
    path = folder / f"step-{step}{'.tmp' if tmp else ''}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    if committed:
        (path / "trainer_state.json").write_text("{}")
    return path


def test_auto_picks_the_latest_committed_dir_never_a_tmp_one(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _fake_step(tmp_path, 2)
    four = _fake_step(tmp_path, 4)
    _fake_step(tmp_path, 6, tmp=True)  # killed mid-save
    _fake_step(tmp_path, 8, committed=False)  # never a real state (no commit marker)
    assert latest_checkpoint(tmp_path) == four
    (tmp_path / "latest").write_text("step-2\n")  # the pointer wins while it names a committed dir
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    (tmp_path / "latest").write_text("step-6.tmp\n")
    assert latest_checkpoint(tmp_path) == four
    assert [p.name for p in committed_steps(tmp_path)] == ["step-2", "step-4"]


def source_in(folder: Path):
    """resolve_source of `folder` under the checkpoint options given as keywords."""
    return lambda **options: resolve_source(folder, CheckpointConfig(**options))


def test_resume_from_choices(tmp_path):
    source = source_in(tmp_path)
    assert source() is None  # auto, nothing saved: start fresh
    with pytest.raises(CheckpointError, match="holds no committed checkpoint"):
        source(resume_from="latest")
    partial = _fake_step(tmp_path, 6, tmp=True)
    with pytest.raises(CheckpointError, match="is not a committed checkpoint dir"):
        source(resume_from=str(partial))
    with pytest.raises(CheckpointError, match="checkpoint.init_from: .* does not exist"):
        source(init_from=str(tmp_path / "absent"))
    assert source(init_from=str(partial)) == (partial, True)  # nothing to resume: model weights only
    two = _fake_step(tmp_path, 2)
    assert source(resume_from="latest") == (two, False)
    assert source(init_from=str(partial)) == (two, False)  # a run with checkpoints resumes, init_from or not
    assert source(resume_from=str(two)) == (two, False)  # back to a step of this run (a rollback): asked for


def test_a_fresh_start_over_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """resume_from='none' starts fresh: into a folder that holds an earlier run's committed checkpoints it would
    overwrite them step by step and prune the rest (found by a bad-input probe). An empty value (an unset shell
    variable: --checkpoint.resume_from=$RESUME) was taken as 'none'; it is refused too."""

    source = source_in(tmp_path)
    assert source(resume_from="none") is None  # nothing saved yet: a fresh start
    with pytest.raises(CheckpointError, match="expected 'auto', 'latest', 'none' or a step-N checkpoint folder"):
        source(resume_from="")
    _fake_step(tmp_path, 6, tmp=True)
    assert source(resume_from="none") is None  # an uncommitted save is no earlier run's checkpoint
    _fake_step(tmp_path, 4)
    expected = f"'{tmp_path}' holds checkpoints of an earlier run (up to step-4): a fresh start would overwrite them"
    for options in (dict(resume_from="none"), dict(resume_from="none", init_from=str(tmp_path / "step-4"))):
        with pytest.raises(CheckpointError, match=re.escape(expected)):
            source(**options)
    assert [p.name for p in committed_steps(tmp_path)] == ["step-4"]


def test_keep_last_prunes_older_only_and_keeps_an_abandoned_future(tmp_path):
    for step in (1, 2, 3, 9):  # step-9 was written by a run that was later resumed from step 3
        _fake_step(tmp_path, step)
    layout.prune(tmp_path, newest=3, keep=2)
    assert [p.name for p in committed_steps(tmp_path)] == ["step-2", "step-3", "step-9"]


def test_manager_saves_and_loads_any_stateful_components_without_a_trainer(tmp_path):
    weights, progress = Box(w=torch.arange(6.0).reshape(2, 3)), Box(step=0)
    extras = []
    manager = CheckpointManager(
        tmp_path, CheckpointConfig(keep_last=2), {"model": weights}, progress, write_extras=extras.append
    )
    for step in (1, 2, 3):
        weights.state["w"] = weights.state["w"] + 1
        progress.state["step"] = step
        manager.save(step)
    assert [p.name for p in committed_steps(tmp_path)] == ["step-2", "step-3"]
    assert extras == [tmp_path / f"step-{s}.tmp" for s in (1, 2, 3)]
    fresh_weights, fresh_progress = Box(w=torch.zeros(2, 3)), Box(step=0)
    fresh = CheckpointManager(tmp_path, CheckpointConfig(), {"model": fresh_weights}, fresh_progress)
    fresh.load(latest_checkpoint(tmp_path))
    assert torch.equal(fresh_weights.state["w"], torch.arange(6.0).reshape(2, 3) + 3)
    assert fresh_progress.state["step"] == 3


def test_async_save_keeps_the_state_as_of_the_save_while_training_changes_it(tmp_path, monkeypatch):
    """Async saves copy the state into staging buffers kept across saves, in a background thread; once
    wait_for_staging() returns (the trainer calls it before each optimizer step) in-place updates no longer
    reach the checkpoint, and the next save refills the same buffers with the new values."""
    slow_stage = DefaultStager._stage

    def stage_slowly(self, state_dict, **kwargs):  # as a GPU-to-host copy of many GB is
        time.sleep(0.3)
        return slow_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", stage_slowly)
    weights, progress = Box(w=torch.zeros(1000)), Box(step=0)
    manager = CheckpointManager(tmp_path, CheckpointConfig(async_mode="async"), {"model": weights}, progress)
    for step in (1, 2):
        progress.state["step"] = step
        manager.save(step)
        manager.wait_for_staging()
        weights.state["w"].add_(1)  # an optimizer step, in place, while the write to disk may still run
    manager.close()
    for step, value in ((1, 0.0), (2, 1.0)):
        loaded = Box(w=torch.full((1000,), -1.0))
        CheckpointManager(tmp_path, CheckpointConfig(), {"model": loaded}, Box(step=0)).load(tmp_path / f"step-{step}")
        assert torch.all(loaded.state["w"] == value), step


def test_async_saves_reuse_one_stager_and_a_save_waits_for_the_previous_to_commit(tmp_path, monkeypatch):
    """One stager for the run (its host buffers, filled again at every save: the same memory for the same
    state), and a save starts only once the previous one is written and committed, however slow the write. On
    torch 2.11, whose stager empties itself after a save, one stager per save."""
    slow_save = CheckpointManager._async_save

    def save_slowly(self, *args):  # the background write of the previous save is still running when the next starts
        slow_save(self, *args)
        future = self.pending[0]
        self.pending = (_Delayed(future), *self.pending[1:])

    monkeypatch.setattr(CheckpointManager, "_async_save", save_slowly)
    weights, progress = Box(w=torch.zeros(1000)), Box(step=0)
    manager = CheckpointManager(tmp_path, CheckpointConfig(async_mode="async"), {"model": weights}, progress)
    stagers = []
    for step in (1, 2):
        progress.state["step"] = step
        manager.save(step)
        assert [path.name for path in committed_steps(tmp_path)] == [
            f"step-{s}" for s in range(1, step)
        ]  # committed first
        stagers.append(manager.stager)
        manager.wait_for_staging()
    if stager_keeps_its_buffers():
        assert stagers[0] is stagers[1]
        state = {"model": weights.state_dict()}
        first, second = (manager.stager.stage(state).result() for _ in range(2))
        assert first["model"]["w"].data_ptr() == second["model"]["w"].data_ptr()  # refilled, not allocated again
    else:  # torch 2.11
        assert stagers[0] is not stagers[1]
    manager.close()
    assert [path.name for path in committed_steps(tmp_path)] == ["step-1", "step-2"]


class _Delayed:
    """A save's write future that takes 0.3 s longer to finish, as a multi-GB write does."""

    def __init__(self, future):
        self.future = future

    def result(self):
        time.sleep(0.3)
        return self.future.result()


def test_async_pinned_is_refused_in_one_line_where_there_is_no_pinned_memory(tmp_path):
    from nanotron.errors import ConfigError

    expected = "checkpoint.async_mode=async_pinned needs pinned host memory, which a cpu device has not; use "
    overrides = [("checkpoint.async_mode", "async_pinned"), ("training.device", "cpu")]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config("configs/tiny.toml", overrides)
    with pytest.raises(ConfigError, match=re.escape(expected)):  # training.device=auto, resolved to cpu at start
        CheckpointManager(tmp_path, CheckpointConfig(async_mode="async_pinned"), {}, Box(step=0), device="cpu")


def trainer_state(tmp_path: Path) -> dict:
    """trainer_state.json as a run saves it: the trainer's progress and the manager's record of the layout."""
    cfg = load_config(None, [])
    progress = Progress(TrainState(step=4, consumed_samples=32), Stability(cfg), tmp_path)
    return progress.state_dict() | {"global_batch_size": 8, "world_size": 2, "layout": layout_sizes(cfg)}


@pytest.mark.parametrize(
    "field, value, expected",
    [
        (None, None, None),  # as saved: loads
        (
            "stability.detector.stats.loss.2",
            float("nan"),
            "stability.detector.stats.loss[2]: expected a finite number >= 0, got nan",
        ),
        (
            "stability.detector.stats.grad_norm.0",
            float("inf"),
            "stability.detector.stats.grad_norm[0]: expected a finite number, got inf",
        ),
        (
            "stability.detector.stats.loss.2",
            -1.0,
            "stability.detector.stats.loss[2]: expected a finite number >= 0, got -1.0",
        ),
        (
            "stability.detector.max_ratio.grad_norm",
            -1.0,
            "stability.detector.max_ratio.grad_norm: expected a finite number >= 0, got -1.0",
        ),
        (
            "stability.detector.mean.loss",
            float("nan"),
            "stability.detector.mean.loss: expected a finite number, got nan",
        ),
        ("stability.rollbacks", -1, "stability.rollbacks: expected an integer >= 0, got -1"),
        ("stability.detector.observed", 2.5, "stability.detector.observed: expected an integer >= 0, got 2.5"),
        (
            "stability.skipped_samples",
            [[5, 3]],
            "stability.skipped_samples[0]: expected [start, end] with 0 <= start < end",
        ),
        ("world_size", 0, "world_size: expected an integer >= 1, got 0"),
        ("consumed_samples", "many", "consumed_samples: expected an integer >= 0, got 'many'"),
        ("step", True, "step: expected an integer >= 0, got True"),
        ("layout.dp", None, "layout.dp: expected an integer >= 1, got None"),
    ],
)
def test_every_field_read_back_from_trainer_state_is_checked_for_type_and_range(tmp_path, field, value, expected):
    """A value saved consistently (checksums and all) but of the wrong type or range is one line naming the file
    and the field: NaN statistics would switch the spike guard off, a negative variance was a math domain error."""
    state = trainer_state(tmp_path)
    if field is not None:
        *path, last = field.split(".")
        record = state
        for key in path:
            record = record[key]
        record[int(last) if isinstance(record, list) else last] = value
    CheckpointManager(tmp_path, CheckpointConfig(), {"model": Box(w=torch.zeros(2))}, Box(**state)).save(4)
    progress = Box()
    loader = CheckpointManager(
        tmp_path, CheckpointConfig(), {"model": Box(w=torch.zeros(2))}, progress, progress_schema=TRAINER_STATE
    )
    if expected is None:
        loader.load(tmp_path / "step-4")
        assert progress.state == json.loads(json.dumps(state))
        return
    with pytest.raises(CheckpointError) as raised:
        loader.load(tmp_path / "step-4")
    message = str(raised.value)
    assert message.startswith(f"'{tmp_path / 'step-4' / 'trainer_state.json'}': {expected}") and "\n" not in message
