"""`python tests/forkrun.py NPROC ARGS...`: `torchrun --standalone --nproc_per_node=NPROC -m nanotron.train ARGS`
for the test suite, its ranks forked from one process that imported the trainer once (`main(nproc, args, module)`:
`-m MODULE ARGS` instead, e.g. benchmarks.memory's worker).

Under torchrun every rank starts a fresh interpreter and imports torch, its distributed packages and dynamo
(~3 s of CPU each on the 2-core test machine), and the launcher imports torch too: a 4-rank run of the tiny model
spent ~17 s of CPU of which its steps took ~3. Forked ranks share the one import. What a rank sees is what torchrun
gives it: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT of a store this launcher holds (torchrun's
agent store), TORCHELASTIC_RUN_ID (so that a rank dies with its launcher), and the exit: when a rank fails the
others get SIGTERM (SIGKILL 30 s later) and the launcher exits 1, as torchrun does.

Tests of the launch itself (torchrun, `nanotron launch`, signals, the watcher) start the real launchers; the layout
matrix and the other multi-process tests use this one (tests/conftest.py `run_train`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

GRACE_SECONDS = 30.0  # torchrun's wait between SIGTERM and SIGKILL of the ranks left after a failure


def preimport() -> None:
    """What a run imports before its first step, for the forks to share (tests/zygote.py imports it too)."""
    import torch.distributed.checkpoint  # noqa: F401 - the checkpoint saves' DCP and fsspec

    import nanotron.commands.train  # noqa: F401
    import nanotron.plan.search  # noqa: F401 - the planner that resolves parallelism.sp_regather = "auto"
    import nanotron.trainer  # noqa: F401 - dynamo and the rest of the trainer: the command imports them lazily


def main(nproc: int, args: list[str], module: str | None = None) -> int:
    preimport()
    from nanotron.commands.train import main as train
    from nanotron.errors import run_as_main

    ports = []
    ranks = {}
    for rank in range(nproc):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a rank: wait for the store's port (the store's threads start after every fork), then train
            os.close(write)
            port = os.read(read, 16).decode()
            os.close(read)
            os.setsid()
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_RUN_ID="forkrun",
                NANOTRON_LAUNCHER_PID=str(os.getppid()),
            )
            sys.argv = [module or "nanotron.train", *args]
            faulthandler.enable(all_threads=True)  # a rank's segfault or abort shows its stacks in the test's output
            run_as_main(lambda: run_module(module) if module else train())  # exits the process
        os.close(read)
        ports.append(write)
        ranks[pid] = rank

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    for write in ports:
        os.write(write, str(store.port).encode())
        os.close(write)
    return wait(ranks)


def run_module(name: str) -> int:
    """`python -m NAME`'s exit code: 0 at its end or for `sys.exit()`, 1 (its message printed) for
    `sys.exit("message")`."""
    import runpy

    from nanotron.errors import exit_status

    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        return exit_status(exit_)
    return 0


def wait(ranks: dict[int, int]) -> int:
    """Waits for every rank; at the first failure stops the others as torchrun does. 0, or 1 when any failed."""
    failed, deadline = False, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                _signal(ranks, signal.SIGKILL)
                deadline = None
            time.sleep(0.05)
            continue
        ranks.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, deadline = True, time.monotonic() + GRACE_SECONDS
            _signal(ranks, signal.SIGTERM)
    return 1 if failed else 0


def _signal(ranks: dict[int, int], signum: int) -> None:
    for pid in ranks:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
