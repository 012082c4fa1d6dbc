"""launch/slurm.sh without a cluster: the script runs as Slurm would run it, against stand-in `srun`/`scontrol`.

The stand-in srun either records what it was asked to run (arguments and environment) or runs the task itself in a
process group of its own and forwards signals to that group only, as a cluster tracking processes by process group
(proctrack/pgid) does. Real jobs on a local cluster run in tests/test_slurm.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_MODEL, TinyData, read_metrics, train_env

JOB_SCRIPT = REPO / "launch" / "slurm.sh"
EPHEMERAL_PORTS = range(32768, 61000)  # Linux's default net.ipv4.ip_local_port_range

RECORDING_SRUN = """
printf '%s\\n' "$@" > "$RECORD/srun-args"
env > "$RECORD/srun-env"
"""

# Runs the task (what follows srun's options) in its own process group and signals only that group.
PGID_SRUN = """
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
set -m
"$@" &
task=$!
trap 'kill -USR1 -- -$task' USR1
trap 'kill -TERM -- -$task' TERM
while :; do
  status=0
  wait $task || status=$?
  kill -0 $task 2>/dev/null || break
done
exit $status
"""

SCONTROL = """
case "$1 $2" in
  "show hostnames") echo 127.0.0.1 ;;
  "show job") echo "   ReqNodeList=(null) ExcNodeList=${EXCLUDED:-(null)}" ;;
  requeue*) echo "$@" >> "$RECORD/requeued" ;;
  update*) echo "$@" >> "$RECORD/updated" ;;
esac
"""


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(f"#!/usr/bin/env bash\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def job_env(tmp_path: Path, srun: str = RECORDING_SRUN, job_id: int = 4242, **extra: str) -> dict[str, str]:
    """A batch job's environment: Slurm's variables, the stand-ins first on PATH, then the venv (as if activated)."""
    stand_in(tmp_path / "bin", "srun", srun)
    stand_in(tmp_path / "bin", "scontrol", SCONTROL)
    prefixes = ("SLURM_", "NCCL_", "TORCH_NCCL_", "NANOTRON_", "OMP_NUM_THREADS")
    env = {k: v for k, v in train_env().items() if not k.startswith(prefixes)}
    path = f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin"
    slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1"}
    slurm |= {"SLURM_CPUS_ON_NODE": "6", "SLURM_JOB_CPUS_PER_NODE": "6(x1)"}
    return {**env, **slurm, "PATH": path, "RECORD": str(tmp_path), **extra}


def free_job_id() -> int:
    """A job id whose rendezvous port (launch/slurm.sh: 10000 + id % 20000) is free now. Two jobs that train at once
    on the two pytest workers under one id (4242: port 14242) meet in one store, and one's rendezvous fails."""
    while True:
        job_id = random.randrange(1, 20000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", 10000 + job_id))
            except OSError:
                continue
        return job_id


def run_script(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(JOB_SCRIPT), "configs/tiny.toml", *args], cwd=REPO, env=env, capture_output=True, text=True
    )


def srun_env(tmp_path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (tmp_path / "srun-env").read_text().splitlines() if "=" in line)


def test_the_job_waits_for_every_node_and_logs_where_it_was_submitted():
    """Slurm reads these before the script runs: they can't be checked from inside it. A log folder that a fresh
    checkout lacks would fail the job before it starts; a job started before every node booted fails its rendezvous."""
    header = [line.split()[1] for line in JOB_SCRIPT.read_text().splitlines() if line.startswith("#SBATCH ")]
    assert "--wait-all-nodes=1" in header
    output = next(option.partition("=")[2] for option in header if option.startswith("--output="))
    assert "/" not in output and output == "%x-%j.out"


def test_each_node_runs_the_local_launcher_with_every_cpu_of_the_node(tmp_path):
    env = job_env(tmp_path, SLURM_JOB_CPUS_PER_NODE="8(x2),6", NPROC_PER_NODE="2")
    proc = run_script(tmp_path, "--training.steps=3", env=env)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun-args").read_text().splitlines()
    assert "--cpus-per-task=6" in args  # the smallest node's CPUs: every task must fit
    assert srun_env(tmp_path)["OMP_NUM_THREADS"] == "3"  # shared by the node's two trainer processes
    launcher = args.index("-m")
    assert args[launcher - 1 : launcher + 3] == ["python", "-m", "nanotron", "torchrun"]
    assert args[-4:] == ["nanotron.train", "--config", "configs/tiny.toml", "--training.steps=3"]


@pytest.mark.parametrize("job_id", [1, 12768, 19999, 22767, 39999, 2**31 - 1])
def test_the_rendezvous_port_stays_out_of_the_ephemeral_range(tmp_path, job_id):
    proc = run_script(tmp_path, env=job_env(tmp_path, job_id=job_id))
    assert proc.returncode == 0, proc.stderr
    port = int(srun_env(tmp_path)["MASTER_PORT"])
    assert 1024 <= port < 65536 and port not in EPHEMERAL_PORTS


@pytest.mark.slow
def test_nccl_defaults_apply_unless_the_user_set_them(tmp_path):
    assert run_script(tmp_path, env=job_env(tmp_path)).returncode == 0
    env = srun_env(tmp_path)
    assert (env["NCCL_DEBUG"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("WARN", "1")

    own = job_env(tmp_path, NCCL_DEBUG="INFO", TORCH_NCCL_ASYNC_ERROR_HANDLING="3")
    assert run_script(tmp_path, env=own).returncode == 0
    env = srun_env(tmp_path)
    assert (env["NCCL_DEBUG"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("INFO", "3")


def test_a_python_without_nanotron_is_one_error_line_before_anything_starts(tmp_path):
    proc = run_script(tmp_path, env=job_env(tmp_path, NANOTRON_PYTHON="/usr/bin/false"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: '/usr/bin/false' cannot import nanotron and torch on ")
    assert "NANOTRON_PYTHON=" in proc.stderr and not (tmp_path / "srun-args").exists()


def python_shim(tmp_path: Path) -> Path:
    """A set-up file that puts a `python` first on PATH (as `conda activate` does) which logs every start: a Python
    started after the set-up ran is seen in shim.log."""
    shim = tmp_path / "env" / "bin"
    shim.parent.mkdir()
    stand_in(shim, "python", f'echo "$*" >> "$RECORD/shim.log"\nexec {sys.executable} "$@"')
    setup = tmp_path / "setup.sh"
    setup.write_text(f'export PATH="{shim}:$PATH"\nmodule_loaded=$UNSET_IN_A_STRICT_SHELL\n')
    return setup


def test_the_set_up_file_is_sourced_before_the_jobs_python_check(tmp_path):
    proc = run_script(tmp_path, env=job_env(tmp_path, NANOTRON_SETUP=str(python_shim(tmp_path))))
    assert proc.returncode == 0, proc.stderr
    assert "nanotron.launch.torchrun" in (tmp_path / "shim.log").read_text()  # the check ran the set-up's Python
    missing = run_script(tmp_path, env=job_env(tmp_path, NANOTRON_SETUP=str(tmp_path / "nope.sh")))
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: NANOTRON_SETUP='{tmp_path}/nope.sh' is not")


def test_a_container_image_and_its_mounts_reach_srun_and_the_host_python_is_not_checked(tmp_path):
    env = job_env(tmp_path, NANOTRON_CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:24.05-py3", NANOTRON_PYTHON="nope")
    env["NANOTRON_CONTAINER_MOUNTS"] = "/data:/data,/scratch:/scratch"
    proc = run_script(tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun-args").read_text().splitlines()
    container = [a for a in args if a.startswith("--container-")]
    assert container == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-workdir={REPO}",
        "--container-mounts=/data:/data,/scratch:/scratch",
    ]


@pytest.mark.slow
def test_every_nodes_task_sources_the_set_up_and_runs_through_the_container_command(tiny_data: TinyData, tmp_path):
    """The set-up's side effect (its Python first on PATH) reaches the node's launcher and the trainers it starts,
    all run through NANOTRON_CONTAINER_EXEC (an apptainer-style wrapper)."""
    wrapper = tmp_path / "bin" / "container-exec"
    stand_in(tmp_path / "bin", "container-exec", 'echo "$*" >> "$RECORD/exec.log"\nshift 2\nexec "$@"')
    env = job_env(tmp_path, srun=PGID_SRUN, job_id=free_job_id(), NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    env |= {"NANOTRON_SETUP": str(python_shim(tmp_path)), "NANOTRON_CONTAINER_EXEC": f"{wrapper} --nv img.sif"}
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--job.name=setup"]
    proc = run_script(tmp_path, *args, "--parallelism.dp=2", "--training.steps=2", "--checkpoint.interval=0", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "setup") if "loss" in r] == [1, 2]
    assert (tmp_path / "exec.log").read_text().startswith("--nv img.sif python -m nanotron torchrun --nnodes 1")
    starts = (tmp_path / "shim.log").read_text().splitlines()
    assert len([s for s in starts if s.startswith("-m nanotron torchrun")]) == 1  # no host check: in the container
    assert len([s for s in starts if s.startswith("-m nanotron.train")]) == 2  # each trainer: the set-up's Python


def test_the_job_exits_with_the_first_failed_nodes_code_not_the_killed_peers(tmp_path):
    # Node 1 stopped on bad input (2); node 2, blocked in a collective, was killed by srun --wait (137).
    failing_srun = (
        'echo "error: [rank 0] training.stepz: unknown key" >&2\n'
        'echo "srun: error: node1: task 0: Exited with exit code 2" >&2\n'
        'echo "srun: error: node2: task 1: Killed" >&2\n'
        "exit 137"
    )
    log = tmp_path / "nanotron-4242.out"
    log.write_text("an earlier run of the job\n")
    with log.open("a") as out:  # as Slurm opens the job's log: stdout and stderr appended to one file
        proc = subprocess.run(
            ["bash", str(JOB_SCRIPT), "configs/tiny.toml"],
            cwd=REPO,
            env=job_env(tmp_path, srun=failing_srun),
            stdout=out,
            stderr=out,
        )
    text = log.read_text()
    assert proc.returncode == 2, text
    assert text.startswith("an earlier run of the job\njob 4242 (restart 0): 1 node(s) x 1 process(es)"), text
    assert "error: [rank 0] training.stepz: unknown key\n" in text  # srun's messages still reach the log
    assert text.endswith("srun: error: node2: task 1: Killed\n"), text


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"gave up waiting for {what} (exit {proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.25)


def trainer_pids(out_dir: Path) -> list[int]:
    """Processes running nanotron.train into `out_dir` (the stand-in cluster runs on this machine)."""
    pids, marks = [], (b"nanotron.train", f"--job.out_dir={out_dir}".encode())
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:
            continue
        if all(mark in text for mark in marks) and b"\0nanotron\0torchrun\0" not in text and b"bash" not in text:
            pids.append(int(cmdline.parent.name))
    return pids


@pytest.mark.slow
def test_preemption_signal_reaches_trainers_tracked_by_process_group_and_pp_saves_are_reported(
    tiny_data: TinyData, tmp_path
):
    """SIGUSR1 to the script (Slurm's --signal=B:USR1) → srun → the node's launcher → its trainers, which live in
    sessions of their own: with pgid process tracking only the launcher can hand it on. A signal while the trainers
    are still starting must not kill them. At pp=2 the checkpoint is committed by rank 0, which is not the logging
    rank: its "checkpoint: saved" line must still be printed."""
    run = tmp_path / "pgid"
    job_id = free_job_id()
    env = job_env(tmp_path, srun=PGID_SRUN, job_id=job_id, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    args = [*TINY_MODEL, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--job.name=pgid"]
    args += ["--parallelism.pp=2", "--training.steps=500", "--checkpoint.interval=0", "--training.device=cpu"]
    proc = subprocess.Popen(
        ["bash", str(JOB_SCRIPT), "configs/tiny.toml", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: len(trainer_pids(tmp_path)) == 2, 60, "the trainer processes to start", proc)
    os.kill(proc.pid, signal.SIGUSR1)  # while they import torch: ignored, or a stop at the first step boundary
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and read_metrics(run) or proc.poll() is not None, 180, "a step", proc)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=180)

    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    stopped = [r["step"] for r in read_metrics(run) if "loss" in r][-1]
    assert stopped < 500 and f"preempted: stopped at step {stopped}" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{stopped}"
    assert f"checkpoint: saved {run / 'checkpoints' / f'step-{stopped}'}" in out
    assert (tmp_path / "requeued").read_text().split() == ["requeue", str(job_id)]


@pytest.mark.slow
def test_a_node_fault_requeues_the_job_without_the_suspect_nodes_until_restarts_stop_helping(tmp_path):
    """Exit code 75 (the watcher named a node): the job is requeued, then told to leave out the suspects (a running
    job's ExcNodeList can't change), keeping what the user excluded; after 3 node faults in a row without a new
    checkpoint it is not requeued again, in one error line."""
    run_dir = tmp_path / "runs" / "faulty"
    faulty_srun = (
        f"mkdir -p {run_dir} && echo node2 > {run_dir}/suspect_nodes.txt\n"
        'echo "hang: rank 2 (node node2) stalled in data at step 7" >&2\n'
        'echo "srun: error: node2: task 1: Exited with exit code 75" >&2\n'
        "exit 75"
    )
    args = [f"--job.out_dir={tmp_path / 'runs'}", "--job.name=faulty"]
    env = job_env(tmp_path, srun=faulty_srun, EXCLUDED="node9")
    for attempt in range(3):
        proc = run_script(tmp_path, *args, env=env)
        assert proc.returncode == 75, proc.stderr
        if attempt < 2:
            assert "node fault: requeueing job 4242 without node9,node2" in proc.stdout, proc.stdout
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"] * 2
    assert (tmp_path / "updated").read_text().split() == ["update", "JobId=4242", "ExcNodeList=node9,node2"] * 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "3 node faults in a row without a new checkpoint (latest: none" in errors[0], (
        proc.stderr
    )
    assert "node fault: requeueing" not in proc.stdout


def test_the_suspects_file_gives_well_formed_node_names_or_one_line(tmp_path):
    """`nanotron suspects` feeds `--exclude`/`ExcNodeList` from suspect_nodes.txt: a line holding several names
    (commas, spaces) gives each once (not `node1,node2,,node3`), and a file that is not text, or names no node,
    is one line naming it (it was a traceback, and the job silently not requeued)."""
    from nanotron.errors import UserError
    from nanotron.watch.suspects import SUSPECTS_FILE, read_suspects

    suspects = tmp_path / SUSPECTS_FILE
    suspects.write_text("node1\n\n node2 ,node3\nnode1\n")
    assert read_suspects(tmp_path) == ["node1", "node2", "node3"]
    for content, expected in ((b"\xff\xfe", "is not text"), (b"node1\nnode;rm\n", "'node;rm' is not a node name")):
        suspects.write_bytes(content)
        with pytest.raises(UserError, match=re.escape(expected)) as error:
            read_suspects(tmp_path)
        assert str(suspects) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("history", ["[1,2", '{"faults": 5}', "[5]"])
def test_an_unreadable_fault_history_is_set_aside_and_the_fault_still_recorded(tmp_path, history, capsys):
    """node_faults.json holds the requeues' no-progress count: a corrupt or foreign one was a traceback in the
    requeue path (no requeue, a traceback in the job log). It is moved aside (kept, named in one warning line) and
    the fault recorded in a new one, so the requeue goes on."""
    from nanotron.watch.suspects import record_fault

    (tmp_path / "node_faults.json").write_text(history)
    record_fault(tmp_path, tmp_path / "checkpoints", 3, job="7", nodes=["node2"], action="requeue")
    kept = sorted(tmp_path.glob("node_faults.json.unreadable*"))
    assert len(kept) == 1 and kept[0].read_text() == history
    faults = json.loads((tmp_path / "node_faults.json").read_text())
    assert [(f["job"], f["nodes"]) for f in faults] == [("7", ["node2"])]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and str(kept[0]) in warnings[0], warnings
