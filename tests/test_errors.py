"""The one error boundary under a distributed launch: the rank that meets bad input says so in one line,
each distinct message once across ranks, peers stop without tracebacks, and the launch exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, train_env

WORKER = """
import os

import torch.distributed as dist

from nanotron.config.parse import load_config
from nanotron.errors import DataError, exit_process, run_command
from nanotron.parallel.mesh import init_distributed


def main(argv):
    world = os.environ["WORLD_SIZE"]
    init_distributed(load_config(None, [("parallelism.dp", world)], world_size=int(world)))  # as a command joins
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
    cmd = [sys.executable, "-m", "nanotron", "torchrun", "--standalone", f"--nproc_per_node={nproc}"]
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


def test_a_dead_launcher_store_is_given_up_at_once_and_quietly(monkeypatch, capfd):
    """When the launcher died (its store with it), a failing rank must not spend 20 s in TCPStore's connect
    retries, printing pages of C++ stack, before it can exit."""
    import socket
    import time

    from nanotron import errors

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    errors._store.cache_clear()
    started = time.monotonic()
    try:
        assert errors._first_failure() is None
        errors._report("the token cache is gone", 2)
    finally:
        errors._store.cache_clear()
    assert time.monotonic() - started < 5
    assert capfd.readouterr().err == "error: [rank ?] the token cache is gone\n"


def test_no_rank_can_fail_before_every_peer_has_connected_to_every_group(monkeypatch):
    """A gloo peer still connecting to a group when a rank leaves prints a C++ error line ("Gloo
    connectFullMesh failed ... remote worker crashing") beside that rank's one-line error (CI, 2026-12-05: a
    rank that failed right after joining). Joining ends with a barrier over the world after the last group is
    built, so no rank's own code runs before every peer has connected."""
    import torch.distributed as dist

    from nanotron.config.parse import load_config
    from nanotron.parallel import mesh
    from nanotron.parallel.torch_private import fake_process_group

    events = []
    for name in ("build_mesh", "expert_mesh"):
        original = getattr(mesh, name)
        monkeypatch.setattr(mesh, name, lambda *a, _f=original, _n=name, **k: events.append(_n) or _f(*a, **k))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: events.append("barrier"))
    cfg = load_config(None, [("parallelism.dp", "2"), ("parallelism.tp", "2")], world_size=4)
    fake_process_group(rank=1, world_size=4)
    try:
        mesh.init_distributed(cfg)
    finally:
        dist.destroy_process_group()
    assert events[-1] == "barrier" and {"build_mesh", "expert_mesh"} <= set(events), events


@pytest.mark.parametrize(
    "body, code, stderr",
    [("sys.exit()", 0, ""), ("sys.exit(3)", 3, ""), ("sys.exit('no corpus at data/')", 1, "no corpus at data/\n")],
    ids=["none", "int", "message"],
)
def test_a_main_that_calls_sys_exit_ends_as_the_interpreter_would_end_it(body, code, stderr):
    """`run_as_main` (every rank's and command's exit) ends with the status Python gives `sys.exit(...)`: 0 for
    none, the number, or 1 with the message printed."""
    program = f"import sys\nfrom nanotron.errors import run_as_main\nrun_as_main(lambda: {body})\n"
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=train_env(), capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (code, stderr)
