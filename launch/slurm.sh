#!/usr/bin/env bash
# The one Slurm job script of nanotron, used by hand and by `python -m nanotron.launch`.
#
#   mkdir -p logs && sbatch --nodes 4 --gpus-per-node 8 launch/slurm.sh configs/large.toml [--section.key=value ...]
#   NPROC_PER_NODE=2 sbatch --nodes 2 launch/slurm.sh configs/tiny.toml --parallelism.dp=4   # CPU nodes
#
# Submit from the repository root (or with nanotron installed): the job runs in the submit directory.
# Options given to sbatch on the command line override the #SBATCH defaults below.
# Ten minutes before the time limit Slurm sends SIGUSR1 to this script ("B:"), which forwards it to
# the trainer; the trainer saves a checkpoint at the next step boundary and exits, and the job
# requeues itself, so the next run resumes from that checkpoint (checkpoint.resume_from="auto").
# With a time limit under ~20 minutes pass a smaller --signal=B:USR1@SECONDS (the launcher does).
#SBATCH --job-name=nanotron
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
set -euo pipefail

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "error: config '${1:-}' not found; usage: sbatch [options] launch/slurm.sh CONFIG [--section.key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift

# One torchrun per node; it starts one trainer process per GPU allocated on the node, or
# NPROC_PER_NODE processes (CPU nodes, or to use fewer GPUs than allocated).
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))   # distinct per job: jobs may share a host
export MASTER_ADDR MASTER_PORT
# CUDA/NCCL defaults (CUDA_DEVICE_MAX_CONNECTIONS by layout, PYTORCH_CUDA_ALLOC_CONF=expandable_segments,
# the NCCL flight recorder dumped into the run dir on a timeout) are set by the trainer from the resolved
# config before CUDA starts (nanotron/gpu.py); export any of them before sbatch to override it.

echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES node(s) x $NPROC_PER_NODE" \
  "process(es), rendezvous $MASTER_ADDR:$MASTER_PORT, config $CONFIG $*"

preempted=0 srun_pid=
forward_usr1() {
  preempted=1
  echo "SIGUSR1: asking the trainer to checkpoint and exit"
  [ -z "$srun_pid" ] || kill -USR1 "$srun_pid" 2>/dev/null || true   # srun forwards it to the step's processes
}
trap forward_usr1 USR1

# torchrun ignores SIGUSR1 (its default action, exit, would kill the workers); the trainer handles it.
srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'trap "" USR1; exec "$@"' _ \
  torchrun --nnodes "$SLURM_NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --max_restarts 0 -m nanotron.train --config "$CONFIG" "$@" &
srun_pid=$!

# A trapped signal interrupts `wait` (status > 128) while srun still runs: wait again.
while :; do
  status=0
  wait "$srun_pid" || status=$?
  if [ "$status" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null; then continue; fi
  break
done

if [ "$preempted" = 1 ] && [ "$status" = 0 ]; then
  echo "preempted: requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint"
  scontrol requeue "$SLURM_JOB_ID" || echo "could not requeue (submitted with --no-requeue?): resubmit to resume"
fi
exit "$status"
