"""The file system fails under a running job (issue 26 item 3): a checkpoint dir that turns read-only mid-run, a
full disk, an unwritable metrics file. Each is one line naming the path and the OS error, the last committed
checkpoint stays committed and `latest`, and the run exits non-zero without a traceback. Needs root (tmpfs
mounts, remounted read-only); each mount is undone whatever happens."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
from conftest import TINY_MODEL, console_message, popen_train, run_train

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root"),
]


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def args(tiny_data, out: Path, ckpt: Path, steps: int) -> list[str]:
    return [
        *TINY_MODEL,
        *tiny_data.overrides(),
        f"--job.out_dir={out}",
        "--job.name=run",
        f"--checkpoint.dir={ckpt}",
        f"--training.steps={steps}",
        "--checkpoint.interval=1",
        "--logging.tensorboard=false",
    ]


def assert_one_line(output: str, *needles: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_a_checkpoint_dir_turning_read_only_mid_run_is_one_line_and_latest_stays(tiny_data, tmp_path):
    with tmpfs(tmp_path / "ckpt", "64m") as ckpt:
        proc = popen_train([*args(tiny_data, tmp_path, ckpt, 2000), "--training.eval_interval=0"])
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "checkpoint: saved" in line and "step-2" in line:
                remount(ckpt, "ro")
                break
        output = "".join(lines) + proc.communicate(timeout=120)[0]
        assert proc.returncode == 2
        assert_one_line(output, str(ckpt), "Read-only file system")
        latest = (ckpt / "latest").read_text().strip()
        assert (ckpt / latest / "trainer_state.json").is_file() and int(latest.removeprefix("step-")) >= 2


@pytest.mark.parametrize("size", ["3m", "1m"], ids=["second-save", "inside-a-tensor-write"])
def test_a_full_disk_names_the_os_error_and_keeps_the_last_checkpoint(tiny_data, tmp_path, size):
    """3 MB: the second save fails as the OS reports it. 1 MB: the first save fails inside torch's serializer,
    which says only "[enforce fail at inline_container.cc] unexpected pos"; the OS error is named all the same."""
    with tmpfs(tmp_path / "ckpt", size) as ckpt:
        proc = run_train([*args(tiny_data, tmp_path, ckpt, 50), "--checkpoint.keep_last=0"], check=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 2
        assert_one_line(output, str(ckpt), "No space left on device")
        if size == "3m":
            latest = (ckpt / "latest").read_text().strip()
            assert (ckpt / latest / "trainer_state.json").is_file()


def test_a_full_run_dir_is_one_line_naming_the_metrics_file(tiny_data, tmp_path):
    """The run dir's disk fills up mid-run (another job's files): the next metrics line can't be written."""
    with tmpfs(tmp_path / "out", "16m") as out:
        proc = popen_train([*args(tiny_data, out, tmp_path / "ckpt", 2000), "--checkpoint.interval=0"])
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if console_message(line).startswith("step "):
                subprocess.run(["dd", "if=/dev/zero", f"of={out / 'filler'}", "bs=1M"], capture_output=True)
                break
        output = "".join(lines) + proc.communicate(timeout=120)[0]
        assert proc.returncode == 2
        assert_one_line(output, str(out / "run" / "metrics.jsonl"), "No space left on device")
