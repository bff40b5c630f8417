#!/usr/bin/env bash
# A single-host SLURM on loopback for tests and CI: start | stop | status.
#
# start: installs the Debian packages (slurmctld slurmd slurm-client munge) only if missing,
#        writes /etc/slurm/slurm.conf (no systemd, no cgroups: proctrack/linuxproc, task/none),
#        starts munged, slurmctld and slurmd, and waits until the node is idle. Idempotent.
# stop:  kills the daemons through their pid files.
# status: prints sinfo; exit 0 when the node is idle.
# Needs root. Exit 0 on success; a non-zero exit says why on stderr.
set -uo pipefail

HOST=$(hostname -s)
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
RUN_DIR=/run/slurm
LOG_DIR=/var/log/slurm
SPOOL=/var/lib/slurm
CPUS=${SLURM_LOCAL_CPUS:-$(nproc)}
HEADROOM_MB=${SLURM_LOCAL_HEADROOM_MB:-2048}

die() { echo "local_cluster: $*" >&2; exit 1; }

install_packages() {
  local missing=()
  for bin in slurmctld slurmd sinfo munged; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]} and not root: cannot apt-get install"
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get here"
  echo "local_cluster: installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || die "apt-get update failed"
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null \
    || die "apt-get install slurmctld slurmd slurm-client munge failed"
}

real_memory_mb() {
  local total_kb
  total_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
  echo $(( total_kb / 1024 - HEADROOM_MB ))
}

write_conf() {
  mkdir -p "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" "$SPOOL/ctld" "$SPOOL/d"
  cat >"$CONF.tmp" <<CONF
# written by scripts/slurm/local_cluster.sh: a single-host cluster on loopback
ClusterName=longctx
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# refuse at submission a job the partition can never run (instead of queueing it forever)
EnforcePartLimits=ALL
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPort=6817
SlurmdPort=6818
# jobs may be requeued (preemption tests); a requeued batch job starts again at once
JobRequeue=1
MinJobAge=300
KillWait=10
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$(real_memory_mb) State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
  mv "$CONF.tmp" "$CONF"
}

alive() {  # alive PIDFILE
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null
  chmod 700 /etc/munge /var/lib/munge /var/log/munge
  chmod 400 /etc/munge/munge.key
  chmod 755 /run/munge
  alive /run/munge/munged.pid && return 0
  runuser -u munge -- /usr/sbin/munged || die "munged did not start"
}

node_state() {
  sinfo -h -N -o '%T' 2>/dev/null | head -1
}

start() {
  [ "$(id -u)" -eq 0 ] || die "start needs root"
  install_packages
  start_munge
  if ! alive "$RUN_DIR/slurmctld.pid" || ! alive "$RUN_DIR/slurmd.pid"; then
    write_conf
  fi
  alive "$RUN_DIR/slurmctld.pid" || /usr/sbin/slurmctld || die "slurmctld did not start"
  alive "$RUN_DIR/slurmd.pid" || /usr/sbin/slurmd || die "slurmd did not start"
  local state=""
  for _ in $(seq 1 60); do
    state=$(node_state)
    case "$state" in
      idle|mixed|allocated) echo "local_cluster: node $HOST $state"; return 0 ;;
      down*|drain*) scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 ;;
    esac
    sleep 1
  done
  die "node $HOST not idle after 60 s (state '${state:-unknown}'); see $LOG_DIR/*.log"
}

stop() {
  local f
  for f in "$RUN_DIR/slurmd.pid" "$RUN_DIR/slurmctld.pid" /run/munge/munged.pid; do
    if alive "$f"; then
      kill "$(cat "$f")" 2>/dev/null
      for _ in $(seq 1 20); do alive "$f" || break; sleep 0.25; done
    fi
  done
  echo "local_cluster: stopped"
}

status() {
  command -v sinfo >/dev/null 2>&1 || die "sinfo not installed"
  sinfo || exit 1
  case "$(node_state)" in idle|mixed|allocated) exit 0 ;; *) exit 1 ;; esac
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
