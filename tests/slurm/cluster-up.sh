#!/usr/bin/env bash
# Start a real Slurm cluster on this one machine for tests/test_slurm.py (Debian's slurm-wlm, root needed):
# one slurmctld plus one slurmd per emulated node, munge auth, no systemd, no cgroups, no accounting DB.
#
#   bash tests/slurm/cluster-up.sh /tmp/slurm && source /tmp/slurm/env.sh    # exports SLURM_CONF
#   bash tests/slurm/cluster-down.sh /tmp/slurm
#
# Knobs (environment), chosen so that two clusters can run side by side with different DIRs and ports:
#   SLURM_LOCAL_NODES=2            emulated nodes, named PREFIX1..PREFIXN, all on 127.0.0.1
#   SLURM_LOCAL_NODE_PREFIX=node   node-name prefix (also what goes into the /etc/hosts block)
#   SLURM_LOCAL_FAKE_GPUS=0        gres/gpu per node, backed by dummy char devices (--gpus-per-node works)
#   SLURM_LOCAL_CPUS=$(nproc)      CPUs declared per node (may exceed the real count)
#   SLURM_LOCAL_PARTITION=debug    the (default) partition
#   SLURM_LOCAL_CTLD_PORT=6817     slurmctld port
#   SLURM_LOCAL_SLURMD_PORT=17001  first slurmd port; node i listens on PORT+i-1
#   SLURM_LOCAL_TIMEOUT=60         seconds to wait for every node to be idle
# Re-running with the same settings while the cluster is up does nothing; otherwise the old daemons of DIR
# are stopped first. Logs: DIR/log. munged is shared by every cluster on the machine and is left running.
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
DIR=$(mkdir -p "$1" && cd "$1" && pwd -P)
NODES=${SLURM_LOCAL_NODES:-2}
PREFIX=${SLURM_LOCAL_NODE_PREFIX:-node}
GPUS=${SLURM_LOCAL_FAKE_GPUS:-0}
CPUS=${SLURM_LOCAL_CPUS:-$(nproc)}
PARTITION=${SLURM_LOCAL_PARTITION:-debug}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-17001}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH SLURM_CONF=$DIR/etc/slurm.conf
say() { echo "[cluster-up] $*" >&2; }
die() { say "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (the daemons run as root and /etc/hosts is edited)"
if ! [ "$NODES" -ge 1 ] 2>/dev/null || ! [ "$GPUS" -ge 0 ] 2>/dev/null; then
  die "SLURM_LOCAL_NODES must be a number >= 1 and SLURM_LOCAL_FAKE_GPUS one >= 0"
fi

# 1. Packages. policy-rc.d (exit 101) keeps the postinst scripts from starting the daemons themselves.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  say "installing slurmctld slurmd slurm-client munge"
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# 2. The configuration. Multiple-slurmd mode: every node is `slurmd -N NAME` on this host, with its own port.
NAMES=()
for i in $(seq 1 "$NODES"); do NAMES+=("$PREFIX$i"); done
NODELIST="${PREFIX}[1-$NODES]"
HOST=$(uname -n) && HOST=${HOST%%.*}
MEM_MB=$(awk '/^MemTotal:/ {m = int($2 / 1024) - 512; print (m > 512 ? m : 512)}' /proc/meminfo)
GRES_NODE="" GRES_TYPES="" GRES_CONF=""
if [ "$GPUS" -gt 0 ]; then
  # gres/gpu must name device files or slurmd reports 0 GPUs; any char device will do, so use /dev/null's.
  GRES_TYPES="GresTypes=gpu" GRES_NODE=" Gres=gpu:$GPUS"
  GRES_CONF="NodeName=$NODELIST Name=gpu File=$DIR/dev/gpu[0-$((GPUS - 1))]"
fi
CONF="# written by tests/slurm/cluster-up.sh: a local test cluster
ClusterName=nanotron-local-test
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
$GRES_TYPES
NodeName=$NODELIST NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$SLURMD_PORT-$((SLURMD_PORT + NODES - 1)) \
CPUs=$CPUS RealMemory=$MEM_MB$GRES_NODE Features=local,cpu State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP"

all_running() {  # every daemon recorded in DIR/run/daemons is still that process, one per node + slurmctld
  local pid program n=0
  [ -f "$DIR/run/daemons" ] || return 1
  while read -r pid program; do
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$program" ] || return 1
    n=$((n + 1))
  done <"$DIR/run/daemons"
  [ "$n" -eq $((NODES + 1)) ]
}

wait_idle() {  # true once every node reports idle
  local deadline=$((SECONDS + TIMEOUT)) states
  while :; do
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)
    [ "$(grep -c ' idle$' <<<"$states")" -eq "$NODES" ] && return 0
    [ "$SECONDS" -lt "$deadline" ] || { say "nodes not idle after ${TIMEOUT}s: ${states:-no answer}"; return 1; }
    sleep 0.5
  done
}

# Keep the daemons of DIR when they already run this very configuration; else stop them and start afresh.
if [ "$(cat "$SLURM_CONF" 2>/dev/null)" = "$CONF" ] && [ "$(cat "$DIR/etc/gres.conf" 2>/dev/null)" = "$GRES_CONF" ] \
   && all_running && timeout 10 scontrol ping >/dev/null 2>&1; then
  say "already running in $DIR"
  fresh=0
else
  fresh=1
  if [ -f "$DIR/run/daemons" ]; then bash "$HERE/cluster-down.sh" "$DIR"; fi
  for port in "$CTLD_PORT" $(seq "$SLURMD_PORT" $((SLURMD_PORT + NODES - 1))); do
    if (: </dev/tcp/127.0.0.1/"$port") 2>/dev/null; then die "port $port is in use (another cluster?)"; fi
  done
fi

# 3. The node names resolve through a block of /etc/hosts marked with DIR (rewritten in place: it may be a
#    bind mount). The host name is added too when it does not resolve: slurmd looks it up.
HOSTS_BEGIN="# BEGIN nanotron test cluster $DIR" HOSTS_END="# END nanotron test cluster $DIR"
names="${NAMES[*]}"
if ! getent hosts "$HOST" >/dev/null; then names+=" $HOST"; fi
# shellcheck disable=SC2094  # /etc/hosts is read whole into $kept before it is rewritten
(
  flock 9
  kept=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts)
  printf '%s\n%s\n127.0.0.1 %s\n%s\n' "$kept" "$HOSTS_BEGIN" "$names" "$HOSTS_END" >/etc/hosts
) 9</etc/hosts

# 4. munge: reuse a working munged, else create the key if needed and start one (as the munge user).
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
  install -d -o munge -g munge -m 0711 /var/lib/munge
  install -d -o munge -g munge -m 0755 /run/munge
  [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  runuser -u munge -- munged --force   # --force: ignore a stale socket left by a dead munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged does not work"
  say "started munged"
fi

# 5. The daemons, with a clean state. Their PID files vanish when they exit: keep our own list.
if [ "$fresh" = 1 ]; then
  rm -rf "${DIR:?}"/{state,spool,run,dev}
  mkdir -p "$DIR"/{etc,state,run,log,dev} "${NAMES[@]/#/$DIR/spool/}"
  printf '%s\n' "$CONF" >"$SLURM_CONF"
  rm -f "$DIR/etc/gres.conf"
  if [ -n "$GRES_CONF" ]; then printf '%s\n' "$GRES_CONF" >"$DIR/etc/gres.conf"; fi
  for i in $(seq 0 $((GPUS - 1))); do mknod "$DIR/dev/gpu$i" c 1 3; done
  slurmctld -f "$SLURM_CONF"
  for name in "${NAMES[@]}"; do slurmd -f "$SLURM_CONF" -N "$name"; done
  for f in slurmctld "${NAMES[@]/#/slurmd-}"; do
    for _ in $(seq 100); do [ -s "$DIR/run/$f.pid" ] && break; sleep 0.1; done
    [ -s "$DIR/run/$f.pid" ] || die "$f did not start; see $DIR/log"
    echo "$(cat "$DIR/run/$f.pid") ${f%%-*}" >>"$DIR/run/daemons"
  done
fi
wait_idle || { tail -n 20 "$DIR"/log/*.log >&2; die "the cluster is not ready; logs in $DIR/log"; }

printf 'export SLURM_CONF=%q\n' "$SLURM_CONF" >"$DIR/env.sh"
sinfo -N >&2
say "ready: source $DIR/env.sh"
