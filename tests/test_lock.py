"""One run per run dir: a live owner refuses a second run in one line; a dead one's lock is taken over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from conftest import TINY_MODEL, popen_train, read_metrics, run_train, wait_for_training

from nanotron.errors import ConfigError
from nanotron.lock import LOCK_FILE, RunLock, lock_run


def write_lock(folder, **owner) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), **owner}))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_held_lock_refuses_a_second_run_naming_the_owner_and_release_frees_it(tmp_path):
    first = RunLock(tmp_path)
    assert first.acquire() is None
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    with RunLock(tmp_path) as again:
        assert again.acquire() is None


def test_a_dead_owner_on_this_host_or_an_earlier_run_of_the_same_slurm_job_is_taken_over(tmp_path, monkeypatch):
    write_lock(tmp_path, pid=dead_pid())
    lock = RunLock(tmp_path)
    assert "which has exited" in lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(tmp_path, host="node7", pid=1, slurm_job_id="4242", slurm_restart=1)  # another step of this run
    with pytest.raises(ConfigError, match=r"\(Slurm job 4242\)"):
        RunLock(tmp_path).acquire()
    write_lock(tmp_path, host="node7", pid=1, slurm_job_id="4242", slurm_restart=0)  # requeued, maybe elsewhere
    assert "Slurm job 4242 (requeued)" in RunLock(tmp_path).acquire()

    (tmp_path / LOCK_FILE).write_bytes(b"\x00\xff garbage")
    assert "unreadable lock file" in RunLock(tmp_path).acquire()


def test_a_lock_of_another_host_or_another_job_is_refused_with_a_way_out(tmp_path, monkeypatch):
    write_lock(tmp_path, host="node7", pid=1234)
    with pytest.raises(ConfigError, match=rf"pid 1234 on node7.*delete {tmp_path / LOCK_FILE}"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "2")
    write_lock(tmp_path, host="node7", pid=1234, slurm_job_id="1")
    with pytest.raises(ConfigError, match=r"\(Slurm job 1\)"):
        RunLock(tmp_path).acquire()


def test_release_never_removes_a_lock_someone_else_took(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    write_lock(tmp_path, host="node7", pid=99)  # e.g. removed by hand and taken by another run
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "node7"


def test_a_checkpoint_dir_outside_the_run_dir_is_locked_too_and_a_failure_releases_what_was_taken(tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "ckpt"
    write_lock(elsewhere, host="node7", pid=1)
    with pytest.raises(ConfigError):
        lock_run([run_dir, elsewhere])
    assert not (run_dir / LOCK_FILE).exists()
    with lock_run([run_dir, run_dir / "checkpoints"]):
        assert (run_dir / LOCK_FILE).is_file() and (run_dir / "checkpoints" / LOCK_FILE).is_file()
    assert not (run_dir / LOCK_FILE).exists() and not (run_dir / "checkpoints" / LOCK_FILE).exists()


def test_one_owner_per_checkpoint_dir_wherever_it_lives(tmp_path):
    """Run A keeps its checkpoints in its run dir (the default). Run B, another job.name, pointing its
    checkpoint.dir at A's checkpoints, or at A's run dir itself, is refused naming checkpoint.dir: otherwise it
    would resume from A's checkpoints, then overwrite and prune them (issue 26 item 1)."""
    a = tmp_path / "runs" / "a"
    with lock_run([a, a / "checkpoints"]):
        for shared in (a / "checkpoints", a):
            with pytest.raises(ConfigError, match=rf"checkpoint.dir: {shared} is in use by another run"):
                lock_run([tmp_path / "runs" / "b", shared])
            assert not (tmp_path / "runs" / "b" / LOCK_FILE).exists()  # what B took is released
    with lock_run([tmp_path / "runs" / "b", a / "checkpoints"]):  # A is gone: B may take them over
        pass


@pytest.mark.slow
def test_a_second_run_on_a_live_run_dir_is_refused_and_the_first_is_untouched(tiny_data, tmp_path):
    args = [*tiny_data.overrides(), *TINY_MODEL, f"--job.out_dir={tmp_path}", "--job.name=shared"]
    first = popen_train([*args, "--training.steps=5000", "--parallelism.dp=2", "--nproc_per_node=2"])
    try:
        wait_for_training(first)
        second = run_train([*args, "--training.steps=3"], check=False)
        errors = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(errors) == 1, second.stderr[-2000:]
        assert errors[0].startswith("error: job.name: the run dir") and "in use by another run" in errors[0]
    finally:
        first.send_signal(signal.SIGTERM)
        output = first.communicate(timeout=180)[0]
    assert first.returncode == 0, output[-2000:]
    steps = [r["step"] for r in read_metrics(tmp_path / "shared") if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved records
    assert not (tmp_path / "shared" / LOCK_FILE).exists()  # released at the end, so the run resumes:
    run_train([*args, f"--training.steps={steps[-1] + 1}"])


# ---- containers: pid namespaces, reboots, reused pids (issue 26 item 2) --------------------------------------


def this_process() -> dict:
    from nanotron.lock import process_identity

    return process_identity()


def test_an_owner_in_another_pid_namespace_is_refused_naming_the_file_even_if_its_pid_looks_dead(tmp_path):
    """Its pid means nothing here: whether it runs can't be decided, so the lock is not taken over."""
    me = this_process()
    write_lock(tmp_path, pid=dead_pid(), boot_id=me["boot_id"], pid_ns="pid:[1]", start_ticks=5)
    with pytest.raises(ConfigError, match=rf"another pid namespace.*delete {tmp_path / LOCK_FILE}") as error:
        RunLock(tmp_path).acquire()
    assert "\n" not in str(error.value)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid_ns"] == "pid:[1]"  # untouched


def test_a_reboot_or_a_reused_pid_frees_the_lock_and_a_live_owner_keeps_it(tmp_path):
    me = this_process()
    write_lock(tmp_path, pid=os.getpid(), boot_id="another-boot", pid_ns=me["pid_ns"], start_ticks=me["start_ticks"])
    lock = RunLock(tmp_path)
    assert "rebooted" in lock.acquire()
    lock.release()
    # pid alive in this namespace but started at another time: another process now has that pid
    write_lock(tmp_path, pid=os.getppid(), boot_id=me["boot_id"], pid_ns=me["pid_ns"], start_ticks=1)
    lock = RunLock(tmp_path)
    assert "reused" in lock.acquire()
    lock.release()
    write_lock(tmp_path, pid=os.getpid(), **{k: me[k] for k in ("boot_id", "pid_ns", "start_ticks")})
    with pytest.raises(ConfigError, match="in use by another run"):
        RunLock(tmp_path).acquire()


UNSHARE = ["unshare", "--pid", "--fork"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_a_run_started_in_its_own_pid_namespace_does_not_take_a_live_lock(tmp_path):
    """The bug: `unshare --pid` sees the owner's pid as dead, took the lock over and both trained."""
    held = RunLock(tmp_path)
    held.acquire()
    code = f"from nanotron.lock import RunLock; RunLock({str(tmp_path)!r}).acquire(); print('TOOK IT')"
    proc = subprocess.run([*UNSHARE, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "TOOK IT" not in proc.stdout and "another pid namespace" in proc.stderr, proc.stderr[-2000:]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    held.release()
