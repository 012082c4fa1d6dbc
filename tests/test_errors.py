"""The one error boundary under a distributed launch: the rank that meets bad input says so in one line,
each distinct message once across ranks, peers stop without tracebacks, and the launch exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, train_env

WORKER = """
import sys

import torch.distributed as dist

from nanotron.errors import DataError, exit_process, run_command


def main(argv):
    dist.init_process_group("gloo")
    rank, mode = dist.get_rank(), argv[0]
    if mode == "all" or (mode == "one" and rank == 1):
        raise DataError(f"the token cache is not visible on this node ({mode})")
    dist.barrier()  # the healthy rank waits here for a peer that has already stopped
    dist.destroy_process_group()
    return 0


exit_process(run_command(main))
"""


def launch(tmp_path, mode: str, nproc: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "nanotron.launch.local", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        [*cmd, str(script), mode], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, expected",
    [
        ("one", "error: [rank 1] the token cache is not visible on this node (one)"),
        ("all", "error: [rank {rank}] the token cache is not visible on this node (all)"),
    ],
)
def test_an_error_on_any_rank_is_one_line_and_the_launch_exits_2(tmp_path, mode, expected):
    proc = launch(tmp_path, mode, nproc=3)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, lines  # one line from three ranks: no duplicates, no peer tracebacks
    assert lines[0] in {expected.format(rank=r) for r in range(3)}, lines


@pytest.mark.slow
def test_a_clean_run_under_the_local_launcher_exits_0(tmp_path):
    proc = launch(tmp_path, "none")
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr[-3000:]
