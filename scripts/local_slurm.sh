#!/usr/bin/env bash
# A two-node Slurm cluster on this machine, for the launcher tests (`areal train` under Slurm):
#   scripts/local_slurm.sh start DIR   # munged (if needed), slurmctld, slurmd n1 and n2; prints `export SLURM_CONF=DIR/slurm.conf`
#   scripts/local_slurm.sh stop DIR    # cancels the cluster's jobs, stops its slurmd and slurmctld (munged keeps running)
# Both nodes are this host (127.0.0.1), one CPU each, partition `debug`; config, state, pid and log files live
# under DIR. Needs root and the Debian packages `slurm-wlm munge`. On failure it exits non-zero with a one-line
# reason as the last line of stderr. `start` on a DIR whose cluster already runs reuses it.
set -euo pipefail

die() { echo "local_slurm: $*" >&2; exit 1; }
log() { echo "local_slurm: $*" >&2; }

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
mkdir -p "$2"
DIR=$(cd "$2" && pwd)
CONF=$DIR/slurm.conf
NODES=(n1 n2)
WAIT_S=${LOCAL_SLURM_WAIT_S:-30}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# the pid in a pid file, if that process is alive and is the named daemon (not a reused pid)
pid_of() {
  local file=$1 name=$2 pid
  [ -f "$file" ] || return 1
  pid=$(tr -dc 0-9 <"$file")
  alive "$pid" || return 1
  grep -q "$name" "/proc/$pid/comm" 2>/dev/null || return 1
  echo "$pid"
}

# number of nodes of this cluster that are idle (or mixed/allocated: up and usable)
idle_nodes() {
  SLURM_CONF=$CONF timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 ~ /^(idle|mixed|allocated)$/' | sort -u | wc -l
}

node_states() {
  SLURM_CONF=$CONF timeout 10 sinfo -h -N -o '%N=%T' 2>/dev/null | sort -u | tr '\n' ' '
}

stop_cluster() {
  local pids=() pid n
  # cancel this cluster's jobs first, so their steps (slurmstepd and the tasks) end with them
  if pid_of "$DIR/slurmctld.pid" slurmctld >/dev/null; then
    SLURM_CONF=$CONF timeout 10 scancel --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 1 20); do
      [ -z "$(SLURM_CONF=$CONF timeout 10 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  for n in "${NODES[@]}"; do
    if pid=$(pid_of "$DIR/slurmd-$n.pid" slurmd); then kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); fi
  done
  if pid=$(pid_of "$DIR/slurmctld.pid" slurmctld); then kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); fi
  # step daemons left behind (started by this cluster's slurmd: SLURM_CONF in their environment)
  for pid in $(pgrep -x slurmstepd 2>/dev/null || true); do
    if { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$CONF"; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; fi
  done
  rm -f "$DIR"/slurmctld.pid "$DIR"/slurmd-*.pid
}

start_munge() {
  command -v munged >/dev/null || die "munged not installed (apt-get install slurm-wlm munge)"
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none || die "cannot write /etc/munge/munge.key"
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key || die "cannot set owner/mode of /etc/munge/munge.key"
  fi
  if pgrep -x munged >/dev/null; then return 0; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  su -s /bin/sh munge -c /usr/sbin/munged >/dev/null 2>&1 || die "munged failed to start (see /var/log/munge/munged.log)"
  for _ in $(seq 1 50); do
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  die "munged started but munge/unmunge does not work (see /var/log/munge/munged.log)"
}

# N free TCP ports on 127.0.0.1 (distinct)
free_ports() {
  local py=${PYTHON:-}
  [ -n "$py" ] || py=$(command -v python3 || command -v python || true)
  [ -n "$py" ] || die "no python3 to pick free ports with"
  "$py" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_conf() {
  local ctld_port=$1 p1=$2 p2=$3 spool=$4
  cat >"$CONF" <<EOF
# written by scripts/local_slurm.sh: a two-node cluster on this host (127.0.0.1)
ClusterName=areal
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool/spool%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=30
MinJobAge=3600
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$p1 CPUs=1 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$p2 CPUs=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES State=UP MaxTime=INFINITE
EOF
}

start_cluster() {
  local b
  for b in slurmctld slurmd sinfo srun sbatch scontrol scancel squeue; do
    command -v "$b" >/dev/null || die "$b not installed (apt-get install slurm-wlm munge)"
  done
  [ "$(id -u)" = 0 ] || die "needs root (slurmd runs as root to start jobs)"

  # already running here: reuse it
  if [ -f "$CONF" ] && pid_of "$DIR/slurmctld.pid" slurmctld >/dev/null \
    && pid_of "$DIR/slurmd-n1.pid" slurmd >/dev/null && pid_of "$DIR/slurmd-n2.pid" slurmd >/dev/null \
    && [ "$(idle_nodes)" -ge 2 ]; then
    log "cluster in $DIR already running; reusing it"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  stop_cluster

  start_munge

  # slurmd keeps Unix sockets in its spool dir (paths limited to ~107 chars): a short dir when DIR is long
  local spool=$DIR
  if [ ${#DIR} -gt 60 ]; then
    spool=$(mktemp -d /tmp/slurmXXXXXX)
    echo "$spool" >"$DIR/spool_root"
  fi
  rm -rf "$DIR/state" "$spool"/spooln1 "$spool"/spooln2
  mkdir -p "$DIR/state" "$spool/spooln1" "$spool/spooln2"
  rm -f "$DIR"/*.log

  local ports
  read -r -a ports <<<"$(free_ports 3)"
  [ ${#ports[@]} -eq 3 ] || die "could not pick free ports"
  write_conf "${ports[0]}" "${ports[1]}" "${ports[2]}" "$spool"

  # SLURM_CONF in the daemons' environment too: their slurmstepd inherit it (`stop` finds strays by it)
  SLURM_CONF=$CONF slurmctld -f "$CONF" >"$DIR/slurmctld.out" 2>&1 \
    || { stop_cluster; die "slurmctld failed to start: $(tail -n1 "$DIR/slurmctld.out" "$DIR/slurmctld.log" 2>/dev/null | grep -v '^==>' | grep . | tail -n1)"; }
  local n
  for n in "${NODES[@]}"; do
    SLURM_CONF=$CONF slurmd -f "$CONF" -N "$n" >"$DIR/slurmd-$n.out" 2>&1 \
      || { stop_cluster; die "slurmd $n failed to start: $(cat "$DIR/slurmd-$n.out" "$DIR/slurmd-$n.log" 2>/dev/null | grep -iE 'error|fatal' | tail -n1)"; }
  done

  local deadline=$((SECONDS + WAIT_S)) resumed=0
  while [ $SECONDS -lt $deadline ]; do
    if [ "$(idle_nodes)" -ge 2 ]; then
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    pid_of "$DIR/slurmctld.pid" slurmctld >/dev/null \
      || { stop_cluster; die "slurmctld exited: $(grep -iE 'error|fatal' "$DIR/slurmctld.log" 2>/dev/null | tail -n1)"; }
    for n in "${NODES[@]}"; do
      pid_of "$DIR/slurmd-$n.pid" slurmd >/dev/null \
        || { stop_cluster; die "slurmd $n exited: $(grep -iE 'error|fatal' "$DIR/slurmd-$n.log" 2>/dev/null | tail -n1)"; }
    done
    # a node registered but left down/drained (e.g. by an earlier cluster's state): resume it once
    if [ $resumed = 0 ] && [ $((deadline - SECONDS)) -lt $((WAIT_S / 2)) ]; then
      SLURM_CONF=$CONF timeout 10 scontrol update NodeName=n1,n2 State=RESUME >/dev/null 2>&1 || true
      resumed=1
    fi
    sleep 0.5
  done
  local states
  states=$(node_states)
  stop_cluster
  die "nodes not idle after ${WAIT_S}s (${states:-sinfo gave no answer}); see $DIR/slurmctld.log"
}

case "$cmd" in
  start) start_cluster ;;
  stop)
    stop_cluster
    if [ -f "$DIR/spool_root" ]; then rm -rf "$(cat "$DIR/spool_root")"; rm -f "$DIR/spool_root"; fi
    ;;
  *) usage ;;
esac
