"""Stop signals from every direction end a run with a checkpoint and exit 0: SIGTERM to a whole process group
(data workers included), SIGINT (a second one aborts), SIGTERM to the local launcher; a SIGKILLed launcher leaves
no workers behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    TINY_MODEL,
    child_pids,
    console_message,
    console_messages,
    train_env,
    wait_for_training,
    worker_pids,
)

from nanotron.checkpoint.layout import latest_checkpoint


def start(tiny_data, tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    """A long tiny run in a process group of its own (as under `timeout`, a shell job or a Slurm step)."""
    args = [*tiny_data.overrides(), *TINY_MODEL, f"--job.out_dir={tmp_path}", f"--job.name={name}"]
    return subprocess.Popen(
        [sys.executable, "-m", "nanotron.train", *args, "--training.steps=5000", *extra],
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def stopped_with_checkpoint(proc: subprocess.Popen, folder: Path) -> str:
    output = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "killed by signal" not in output, output[-3000:]
    line = next(line for line in console_messages(output) if line.startswith("preempted: stopped at step"))
    step = int(line.split()[4])
    assert latest_checkpoint(folder / "checkpoints") == folder / "checkpoints" / f"step-{step}", output[-2000:]
    return output


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_data_workers_checkpoints_and_exits_0(tiny_data, tmp_path):
    proc = start(tiny_data, tmp_path, "group", "--data.num_workers=2")
    wait_for_training(proc)
    assert len(child_pids(proc.pid)) >= 2  # the DataLoader workers, which share the trainer's process group
    os.killpg(proc.pid, signal.SIGTERM)
    stopped_with_checkpoint(proc, tmp_path / "group")


@pytest.mark.slow
def test_ctrl_c_checkpoints_like_sigterm_and_a_second_one_aborts_at_once(tiny_data, tmp_path):
    proc = start(tiny_data, tmp_path, "interrupted", "--data.num_workers=1")
    wait_for_training(proc)
    os.killpg(proc.pid, signal.SIGINT)
    output = stopped_with_checkpoint(proc, tmp_path / "interrupted")
    assert "interrupt again to abort" in output

    proc = start(tiny_data, tmp_path, "aborted", "--checkpoint.interval=0")
    wait_for_training(proc)
    os.killpg(proc.pid, signal.SIGINT)
    next(line for line in proc.stdout if console_message(line).startswith("interrupt:"))  # the first one was handled
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and "aborting without a checkpoint" in output and "Traceback" not in output, output


@pytest.mark.slow
def test_sigterm_to_the_local_launcher_stops_its_workers_cleanly_and_it_exits_0(tiny_data, tmp_path):
    proc = start(tiny_data, tmp_path, "launched", "--parallelism.dp=2", "--nproc_per_node=2", "--data.num_workers=1")
    wait_for_training(proc)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher alone: its workers run in sessions of their own
    stopped_with_checkpoint(proc, tmp_path / "launched")


def trainers_of(out_dir: Path) -> list[int]:
    mark = f"--job.out_dir={out_dir}".encode()
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if mark in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("console", ["kept", "gone"])
def test_a_sigkilled_launcher_leaves_no_worker_behind(tiny_data, tmp_path, console):
    """The workers get SIGTERM when their launcher dies: with a console they stop at a step boundary with a
    checkpoint; without one (its pipe closed too, as when a terminal or `tee` goes) they end all the same."""
    proc = start(tiny_data, tmp_path, "orphans", "--parallelism.dp=2", "--nproc_per_node=2", "--data.num_workers=1")
    wait_for_training(proc)
    assert len(worker_pids(proc.pid)) == 2
    proc.kill()
    if console == "gone":
        proc.stdout.close()
        proc.wait(timeout=30)
    else:
        proc.communicate(timeout=120)  # reads until every worker has closed the console
    deadline = time.monotonic() + 90
    while trainers_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not trainers_of(tmp_path), "workers (or their data workers) outlived their killed launcher"
    if console == "kept":
        assert latest_checkpoint(tmp_path / "orphans" / "checkpoints") is not None  # saved at a step boundary
