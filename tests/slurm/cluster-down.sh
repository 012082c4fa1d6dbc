#!/usr/bin/env bash
# Stop the cluster that tests/slurm/cluster-up.sh started in DIR:
#   bash tests/slurm/cluster-down.sh DIR
# Cancels its jobs, stops the daemons listed in DIR/run/daemons (by PID, after checking that the PID is still
# that program; never by name), kills job steps of this cluster that outlived them, removes DIR's /etc/hosts
# block and DIR/env.sh. munged is shared with other clusters and stays; DIR/log stays. Safe to run twice.
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
[ -d "$1" ] || exit 0
DIR=$(cd "$1" && pwd -P)
DAEMONS=$DIR/run/daemons
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH SLURM_CONF=$DIR/etc/slurm.conf
say() { echo "[cluster-down] $*" >&2; }
running() {  # PID PROGRAM: that PID is a live (not zombie) PROGRAM process
  [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] && ! grep -q '^State:[[:space:]]*[ZX]' "/proc/$1/status" 2>/dev/null
}

# 1. Cancel the jobs while slurmd is still there to end their processes.
if [ -f "$SLURM_CONF" ] && timeout 10 scontrol ping >/dev/null 2>&1; then
  jobs=$(squeue -h -o %i 2>/dev/null || true)
  if [ -n "$jobs" ]; then
    say "cancelling jobs ${jobs//$'\n'/ }"
    # shellcheck disable=SC2086  # one job id per word
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 60); do
      if [ -z "$(squeue -h -o %i 2>/dev/null)" ]; then break; fi
      sleep 0.5
    done
  fi
fi

# 2. The recorded daemons, slurmd before slurmctld: SIGTERM, then SIGKILL after 15 s.
stop() {  # PROGRAM
  local pid program pids=() left
  while read -r pid program; do
    if [ "$program" = "$1" ] && running "$pid" "$1"; then pids+=("$pid"); fi
  done <"$DAEMONS"
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 150); do
    left=()
    for pid in "${pids[@]}"; do if running "$pid" "$1"; then left+=("$pid"); fi; done
    [ ${#left[@]} -gt 0 ] || break
    sleep 0.1
  done
  if [ ${#left[@]} -gt 0 ]; then kill -KILL "${left[@]}" 2>/dev/null || true; fi
  say "stopped $1 ${pids[*]}"
}
if [ -f "$DAEMONS" ]; then
  stop slurmd
  stop slurmctld
  rm -f "$DAEMONS"
fi

# 3. Job steps of this cluster left behind (slurmstepd inherits SLURM_CONF from our slurmd) and their
#    processes, found by PID and environment.
tree() { local child; echo "$1"; for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$child"; done; }
leftovers=()
for proc in /proc/[0-9]*; do
  if [ "$(cat "$proc/comm" 2>/dev/null)" = slurmstepd ] && grep -qzxF "SLURM_CONF=$SLURM_CONF" "$proc/environ" 2>/dev/null
  then
    mapfile -t -O ${#leftovers[@]} leftovers < <(tree "${proc#/proc/}")
  fi
done
if [ ${#leftovers[@]} -gt 0 ]; then
  say "killing leftover job steps and their processes: ${leftovers[*]}"
  kill -KILL "${leftovers[@]}" 2>/dev/null || true
fi

# 4. DIR's /etc/hosts block (rewritten in place: /etc/hosts may be a bind mount) and env.sh.
HOSTS_BEGIN="# BEGIN nanotron test cluster $DIR" HOSTS_END="# END nanotron test cluster $DIR"
if grep -qxF "$HOSTS_BEGIN" /etc/hosts; then
  # shellcheck disable=SC2094  # /etc/hosts is read whole into $kept before it is rewritten
  (
    flock 9
    kept=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
  ) 9</etc/hosts
  say "removed the /etc/hosts block"
fi
rm -f "$DIR/env.sh"
say "done"
