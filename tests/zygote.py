"""`python tests/zygote.py SOCKET`: the suite's fork server for training runs (tests/conftest.py `run_train`).

A fresh `python -m nanotron.train` spends ~4 s of CPU importing torch, its distributed packages, dynamo and the
trainer before its first step, and the suite starts ~300 tiny runs whose training takes a few seconds each: a third
of the suite's CPU went to imports. This process imports all of that once per pytest worker, then forks each run on
request: the run gets the request's argv, environment, working directory and standard streams, and is what the
command would have been — `python -m nanotron.train ARGS` for one process, tests/forkrun.py's launcher (ranks
forked from it in turn) for more.

A request may instead name a module (`python -m MODULE ARGS`, e.g. a benchmark's `--quick` run in
tests/test_benchmarks.py, whose own training runs are then forked from it: benchmarks/common.py FORK_LAUNCHER; or,
with several processes, `torchrun -m MODULE ARGS`, e.g. benchmarks.memory's worker in tests/test_memory.py).

Protocol, one connection per run: the client sends a JSON request {"args", "nproc", "env", "cwd"} (and "module"
for a module) with three file descriptors (stdin, stdout, stderr) attached; a handler forked for the connection
forks the run, answers "pid N\\n", waits for it and answers "rc N\\n" (subprocess's returncode: -N for signal N).
The client kills the pid at its deadline. Linux only (PR_SET_PDEATHSIG): the server dies with the pytest worker
that started it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys


def preimport() -> None:
    """What a run imports (forkrun's list), and forkrun itself."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import forkrun

    forkrun.preimport()


def serve(path: str) -> None:
    from nanotron.signals import die_with_parent

    die_with_parent(signal.SIGKILL)
    preimport()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(8)
    os.rename(path + ".tmp", path)  # the client waits for the name: it appears once the server accepts
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            try:
                handle(conn)
            finally:
                os._exit(0)
        conn.close()
        while True:  # reap the handlers that are done
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def handle(conn: socket.socket) -> None:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        conn.close()
        run(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"rc {os.waitstatus_to_exitcode(status)}\n".encode())


def run(request: dict, fds: list[int]) -> None:
    """The run, in the forked child: its streams, environment, directory and argv, then the command."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    random.seed()  # a fresh interpreter's: forked children would all share the server's state
    import forkrun

    from nanotron.errors import run_as_main

    args, nproc, module = request["args"], request["nproc"], request.get("module")
    if module and nproc == 1:  # `python -m MODULE ARGS` (a benchmark's --quick run, benchmarks.memory's worker)
        sys.argv = [module, *args]
        run_as_main(lambda: forkrun.run_module(module))
    if nproc == 1:
        from nanotron.commands.train import main

        sys.argv = ["nanotron.train", *args]
        run_as_main(main)
    sys.argv = ["forkrun.py", str(nproc), *args]  # torchrun's ranks, of nanotron.train or of the module
    run_as_main(lambda: forkrun.main(nproc, args, module))


if __name__ == "__main__":
    serve(sys.argv[1])
