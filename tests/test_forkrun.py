"""tests/forkrun.py, the suite's launcher of multi-process runs, ends a failed run as torchrun does."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TINY_MODEL, read_metrics, run_train


@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_the_launch_with_1_and_no_rank_left(tiny_data, tmp_path, monkeypatch):
    """Rank 1 SIGKILLed at step 2 (an injected crash): the launch exits 1 as torchrun's does, and ends within
    seconds, not at the 5-minute collective timeout: rank 0 sees gloo's broken connection (the launcher's SIGTERM to
    the ranks left is the backstop for a rank that would not)."""
    monkeypatch.setenv("NANOTRON_FAULT", "rank:1,step:2,kind:crash")
    args = [*TINY_MODEL, *tiny_data.overrides(), "--parallelism.dp=2", "--training.steps=6", "--checkpoint.interval=0"]
    args += [f"--job.out_dir={tmp_path}", "--distributed.timeout_minutes=5"]
    started = time.monotonic()
    proc = run_train(args, nproc=2, check=False, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - started < 60, proc.stderr[-3000:]


def test_a_process_a_test_leaves_running_is_killed_and_named_when_the_test_ends():
    """tests/conftest.py: a test that fails or times out mid-run leaves no ranks running beside the next tests,
    including a rank in a session of its own (as forkrun's and torchrun's are)."""
    from conftest import TEST_VARIABLE, _ends_its_processes

    with pytest.warns(UserWarning, match=r"the test left 1 process\(es\) running; killed"):
        with _ends_its_processes("the test"):
            proc = subprocess.Popen(["sleep", "600"], env=os.environ.copy(), start_new_session=True)  # exec'd
            # Popen returns as exec closes its pipe, before the kernel has written the new program's environment
            # (/proc/PID/environ reads empty for that moment: ~5 % of starts here): wait for a running program
            marker, environ = f"{TEST_VARIABLE}={os.environ[TEST_VARIABLE]}".encode(), Path(f"/proc/{proc.pid}/environ")
            deadline = time.monotonic() + 10
            while marker not in environ.read_bytes().split(b"\0") and time.monotonic() < deadline:
                time.sleep(0.001)
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.slow
def test_a_zygote_run_gets_the_tests_directory_arguments_and_environment(tiny_data, tmp_path, monkeypatch):
    """tests/zygote.py's runs are what `python -m nanotron.train` started by subprocess would be: relative paths
    resolve in the test's cwd, and a variable the test sets reaches the trainer (a fault injected at step 2)."""
    monkeypatch.setenv("NANOTRON_FAULT", "rank:0,step:2,kind:crash")
    args = [*TINY_MODEL, *tiny_data.overrides(), "--job.out_dir=out", "--job.name=here", "--training.steps=3"]
    proc = run_train(args, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0 and [r["step"] for r in read_metrics(tmp_path / "out" / "here")] == [1], proc.stderr
