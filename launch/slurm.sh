#!/usr/bin/env bash
# The one Slurm job script of nanotron, used by hand and by `python -m nanotron.launch`.
#
#   sbatch --nodes 4 --gpus-per-node 8 launch/slurm.sh configs/large.toml [--section.key=value ...]
#   NPROC_PER_NODE=2 sbatch --nodes 2 launch/slurm.sh configs/tiny.toml --parallelism.dp=4   # CPU nodes
#   NPROC_PER_NODE=2 sbatch --nodes 2 launch/slurm.sh configs/long.toml                      # 16k tokens, cp 4
#
# World size = nodes x processes per node = dp x cp x tp x pp (checked by the trainer before any collective).
#
# Submit from the repository root with nanotron's Python environment active: the job runs in the submit directory,
# inherits the submitting shell's environment and runs `python -m nanotron torchrun` with the `python` found on
# PATH (NANOTRON_PYTHON=/path/to/python picks another). The log is <job name>-<job id>.out in the submit directory.
# Every node's environment, set in the submitting shell (the launcher's --setup, --container_* set the same):
#   NANOTRON_SETUP=FILE                    sourced on every node before Python starts (module load, conda activate)
#   NANOTRON_CONTAINER_IMAGE=IMAGE         each node's task runs in it (pyxis/enroot: srun --container-image),
#   NANOTRON_CONTAINER_MOUNTS=SRC:DST,...  with these mounts (the repository, data and run dir must be visible)
#   NANOTRON_CONTAINER_EXEC="apptainer exec --nv IMAGE.sif"   or each node's task runs through this command
# Options given to sbatch on the command line override the #SBATCH defaults below.
# Ten minutes before the time limit Slurm sends SIGUSR1 to this script ("B:"), which forwards it to
# the trainer; the trainer saves a checkpoint at the next step boundary and exits, and the job
# requeues itself, so the next run resumes from that checkpoint (checkpoint.resume_from="auto").
# With a time limit under ~20 minutes pass a smaller --signal=B:USR1@SECONDS (the launcher does).
#SBATCH --job-name=nanotron
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --wait-all-nodes=1
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
set -euo pipefail

fail() {
  echo "error: $*" >&2
  exit 2
}

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  fail "config '${1:-}' not found; usage: sbatch [options] launch/slurm.sh CONFIG [--section.key=value ...]"
fi
CONFIG=$1
shift

# ---- Set-up and Python: checked here, so a job started without nanotron's environment fails in one line ------------
SETUP=${NANOTRON_SETUP:-}
CONTAINER="${NANOTRON_CONTAINER_IMAGE:-}${NANOTRON_CONTAINER_EXEC:-}"
if [ -n "$SETUP" ] && { [ ! -f "$SETUP" ] || [ ! -r "$SETUP" ]; }; then
  fail "NANOTRON_SETUP='$SETUP' is not a readable file (the shell file every node sources before Python starts)"
fi
PYTHON=${NANOTRON_PYTHON:-python}
if [ -z "$CONTAINER" ]; then   # in a container, Python is the image's: each node's task finds out
  if [ -n "$SETUP" ]; then
    set +u   # set-up files (module, conda) read unset variables
    # shellcheck source=/dev/null
    . "$SETUP" || fail "NANOTRON_SETUP='$SETUP' failed (exit $?) on ${SLURMD_NODENAME:-$(hostname)}"
    set -u
  fi
  if ! "$PYTHON" -c 'import importlib.util as u, nanotron.launch.torchrun; raise SystemExit(u.find_spec("torch") is None)' \
    2>/dev/null; then
    fail "'$PYTHON' cannot import nanotron and torch on ${SLURMD_NODENAME:-$(hostname)}: activate nanotron's" \
      "environment before sbatch (the job inherits it), set NANOTRON_SETUP=FILE to activate it on every node, or" \
      "NANOTRON_PYTHON=/path/to/env/bin/python"
  fi
fi

# ---- Layout and rendezvous -----------------------------------------------------------------------------------------
# One launcher per node; it starts one trainer process per GPU allocated on the node, or
# NPROC_PER_NODE processes (CPU nodes, or to use fewer GPUs than allocated).
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# All CPUs of the smallest node go to its one task (launcher, trainer processes, data workers): by default srun
# gives a task one CPU, and clusters that bind tasks to CPUs would squeeze every process onto it.
CPUS_PER_TASK=$(echo "${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}" | tr ',' '\n' | sed 's/(.*//' | sort -n | head -n 1)
# ... shared by the node's trainer processes (torchrun would set 1 and warn about it).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS_PER_TASK / NPROC_PER_NODE > 1 ? CPUS_PER_TASK / NPROC_PER_NODE : 1 ))}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# Distinct per job (jobs may share a host), and below Linux's ephemeral range (32768-60999), from which the OS picks
# the local ports of outgoing connections: one of those could already hold the rendezvous port.
MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
# CUDA/NCCL defaults (CUDA_DEVICE_MAX_CONNECTIONS by layout, PYTORCH_CUDA_ALLOC_CONF=expandable_segments,
# the NCCL flight recorder dumped into the run dir on a timeout) are set by the trainer from the resolved
# config before CUDA starts (nanotron/gpu.py); export any of them before sbatch to override it.

# ---- NCCL defaults (values set in the submitting environment win) --------------------------------------------------
# WARN reports NCCL problems without flooding the log; error handling 1 aborts the communicator and ends the process
# when a collective fails or times out, so a job with a dead peer fails (and can requeue) instead of hanging.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES node(s) x $NPROC_PER_NODE" \
  "process(es), $CPUS_PER_TASK CPUs per node, rendezvous $MASTER_ADDR:$MASTER_PORT, python $PYTHON," \
  "config $CONFIG $*"

# ---- Signals -------------------------------------------------------------------------------------------------------
preempted=0 srun_pid=
forward_usr1() {
  preempted=1
  echo "SIGUSR1: asking the trainer to checkpoint and exit"
  [ -z "$srun_pid" ] || kill -USR1 "$srun_pid" 2>/dev/null || true   # srun hands it to each node's launcher
}
trap forward_usr1 USR1
# At the time limit, on preemption or scancel, Slurm sends SIGTERM to the trainers too; this script keeps waiting, so
# the trainers have the cluster's KillWait to save a checkpoint.
trap 'echo "SIGTERM: the trainer saves a checkpoint if it has time"' TERM

# ---- Run -----------------------------------------------------------------------------------------------------------
# srun's own messages pass through a reader that keeps its "task N: Exited with exit code C" lines: the job's exit code
# is the first failed node's (2 for bad input, 3 for a diverged run, 4 for a loss spike the policy stops at), not that of the peers stopped after it.
work=$(mktemp -d "${TMPDIR:-/tmp}/nanotron-job-$SLURM_JOB_ID.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkfifo "$work/srun-stderr" && : >"$work/exits"
(
  trap '' TERM INT USR1 HUP   # the reader must outlive signals to the job: srun would die writing to a closed pipe
  exec awk -v exits="$work/exits" '
    { print | "cat >&2"; fflush("cat >&2") }
    /: task [0-9]+: Exited with exit code [0-9]+/ { print > exits; fflush(exits) }' <"$work/srun-stderr"
) &
reader_pid=$!

# Each node runs `python -m nanotron torchrun`: torchrun that exits with its first failed worker's code and hands
# SIGUSR1 to its trainers, which run in sessions of their own that a cluster tracking processes by process group would
# not signal. Launcher and trainers start with SIGUSR1 ignored ('trap "" USR1' survives exec), so a signal that comes
# while they start can't kill them; each handles it once it can (the launcher forwards it, the trainer stops at a step
# boundary). A worker stopped by bad input makes its peers stop within seconds with the same code, so srun lets every
# node end by itself (--kill-on-bad-exit=0) and kills the nodes still running 60 s after the first one ended (a crash
# that left peers blocked in a collective).
# Each task sources NANOTRON_SETUP and runs through NANOTRON_CONTAINER_EXEC (word-split: a command and its options),
# inside NANOTRON_CONTAINER_IMAGE when set.
container=()
if [ -n "${NANOTRON_CONTAINER_IMAGE:-}" ]; then
  container=(--container-image="$NANOTRON_CONTAINER_IMAGE" --container-workdir="$PWD")
  [ -z "${NANOTRON_CONTAINER_MOUNTS:-}" ] || container+=(--container-mounts="$NANOTRON_CONTAINER_MOUNTS")
fi
srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=0 --wait=60 \
  ${container[@]+"${container[@]}"} \
  bash -c 'trap "" USR1; if [ -n "${NANOTRON_SETUP:-}" ]; then . "$NANOTRON_SETUP" || exit 2; fi
    exec ${NANOTRON_CONTAINER_EXEC:-} "$@"' _ \
  "$PYTHON" -m nanotron torchrun --nnodes "$SLURM_NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --max_restarts 0 \
  --no-python bash -c 'trap "" USR1; exec "$0" "$@"' "$PYTHON" -m nanotron.train --config "$CONFIG" "$@" \
  2>"$work/srun-stderr" &
srun_pid=$!

# A trapped signal interrupts `wait` (status > 128) while srun still runs: wait again.
while :; do
  status=0
  wait "$srun_pid" || status=$?
  if [ "$status" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null; then continue; fi
  break
done
wait "$reader_pid" || true

first_failure=$(sed -n 's/.*: task [0-9]*: Exited with exit code \([0-9]*\).*/\1/p' "$work/exits" | head -n 1)
if [ "$status" != 0 ] && [ -n "$first_failure" ] && [ "$first_failure" != 0 ]; then
  status=$first_failure
fi

if [ "$status" = 75 ]; then   # a node fault: the watcher (or the straggler scores) named the nodes to leave out
  if suspects=$("$PYTHON" -m nanotron suspects --job "$SLURM_JOB_ID" --config "$CONFIG" "$@") && [ -n "$suspects" ]; then
    excluded=$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/.*ExcNodeList=\([^ ]*\).*/\1/p')
    [ -z "$excluded" ] || [ "$excluded" = "(null)" ] || suspects="$excluded,$suspects"
    echo "node fault: requeueing job $SLURM_JOB_ID without $suspects; it resumes from the latest checkpoint"
    # Requeue first: a running job's ExcNodeList can't be changed. The requeue's SIGTERM (to the script, trapped
    # above, and to its children) must not kill the update: it runs with SIGTERM ignored.
    if scontrol requeue "$SLURM_JOB_ID"; then
      (trap '' TERM; scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$suspects") ||
        echo "could not exclude $suspects: the requeued job may land on them again"
    else
      echo "could not requeue (submitted with --no-requeue?): resubmit with --exclude=$suspects to resume"
    fi
  fi
fi

if [ "$preempted" = 1 ] && [ "$status" = 0 ]; then
  echo "preempted: requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint"
  scontrol requeue "$SLURM_JOB_ID" || echo "could not requeue (submitted with --no-requeue?): resubmit to resume"
fi
exit "$status"
