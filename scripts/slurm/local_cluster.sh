#!/usr/bin/env bash
# A SLURM cluster of N nodes on one host, on loopback, for tests and CI: start | stop | status.
#
# start: installs the Debian packages (slurmctld slurmd slurm-client munge) only if missing,
#        writes /etc/slurm/slurm.conf (no systemd, no cgroups: proctrack/linuxproc, task/none)
#        with SLURM_LOCAL_NODES nodes n1..nN (default 2), one slurmd each (`slurmd -N n<i>`,
#        port 17000+i), the host's CPUs and memory split evenly among them, and maps the node
#        names to 127.0.0.1 in /etc/hosts (ranks reach MASTER_ADDR=<first node> by name).
#        Starts munged, slurmctld and the slurmds, and waits until every node is idle.
#        Idempotent; a running cluster with another layout is restarted only when no job is
#        queued (it waits up to SLURM_LOCAL_QUEUE_WAIT seconds, default 120, then refuses).
# stop:  waits for queued jobs the same way (then stops anyway, naming them), and kills the
#        daemons through their pid files.
# status: prints sinfo; exit 0 when every node is idle, mixed or allocated.
# Needs root. Exit 0 on success; a non-zero exit says why on stderr.
set -uo pipefail

HOST=$(hostname -s)
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
RUN_DIR=/run/slurm
LOG_DIR=/var/log/slurm
SPOOL=/var/lib/slurm
NODES=${SLURM_LOCAL_NODES:-2}
# (nproc obeys OMP_NUM_THREADS, which tests and jobs set to 1: not the machine's count)
CPUS=${SLURM_LOCAL_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
HEADROOM_MB=${SLURM_LOCAL_HEADROOM_MB:-2048}
QUEUE_WAIT=${SLURM_LOCAL_QUEUE_WAIT:-120}
FIRST_PORT=17001
HOSTS_TAG="# longctx local_cluster"

die() { echo "local_cluster: $*" >&2; exit 1; }

node_names() { seq -f 'n%g' 1 "$NODES"; }

check_layout() {
  [[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_NODES=$NODES: expected an integer >= 1"
  [[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_CPUS=$CPUS: expected an integer >= 1"
  [ "$NODES" -le "$CPUS" ] \
    || die "SLURM_LOCAL_NODES=$NODES nodes, but only $CPUS CPUs to split (at least 1 per node)"
  [ "$(node_memory_mb)" -ge 256 ] || die "SLURM_LOCAL_NODES=$NODES: under 256 MB per node"
}

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

node_memory_mb() {  # the host's memory less the headroom, split evenly among the nodes
  local total_kb
  total_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
  echo $(( (total_kb / 1024 - HEADROOM_MB) / NODES ))
}

conf_text() {
  local i
  cat <<CONF
# written by scripts/slurm/local_cluster.sh: $NODES nodes on one host, on loopback
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
SlurmctldLogFile=$LOG_DIR/slurmctld.log
StateSaveLocation=$SPOOL/ctld
SlurmctldPort=6817
# one slurmd per node on this host (slurmd -N <node>); %n is the node name
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmdSpoolDir=$SPOOL/d-%n
# jobs may be requeued (preemption tests); a requeued batch job starts again at once
JobRequeue=1
MinJobAge=300
KillWait=10
CONF
  for i in $(seq 1 "$NODES"); do
    echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((FIRST_PORT + i - 1))" \
      "CPUs=$((CPUS / NODES)) RealMemory=$(node_memory_mb) State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
}

map_node_names() {  # n1..nN -> 127.0.0.1, as a real cluster's DNS would resolve its nodes
  local missing=() node
  for node in $(node_names); do
    getent hosts "$node" >/dev/null || missing+=("$node")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "127.0.0.1 ${missing[*]} $HOSTS_TAG" >>/etc/hosts \
    || die "cannot map ${missing[*]} to 127.0.0.1 in /etc/hosts"
}

alive() {  # alive PIDFILE
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

slurmd_pid() { echo "$RUN_DIR/slurmd-$1.pid"; }

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

queued_jobs() {  # job ids still pending or running, one line; empty when none (or no ctld)
  alive "$RUN_DIR/slurmctld.pid" || return 0
  squeue -h -o '%i' 2>/dev/null | tr '\n' ' ' | sed 's/ $//'
}

wait_for_empty_queue() {  # 0 once no job is queued; 1 after QUEUE_WAIT seconds
  local jobs
  for _ in $(seq 1 "$QUEUE_WAIT"); do
    [ -z "$(queued_jobs)" ] && return 0
    sleep 1
  done
  jobs=$(queued_jobs)
  [ -z "$jobs" ]
}

cluster_up() {  # the running daemons are this layout's
  alive "$RUN_DIR/slurmctld.pid" || return 1
  cmp -s "$CONF" <(conf_text) || return 1
  local node
  for node in $(node_names); do alive "$(slurmd_pid "$node")" || return 1; done
}

wait_idle() {
  local states node
  for _ in $(seq 1 60); do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null)
    if [ "$(echo "$states" | grep -cE ' (idle|mixed|allocated)$')" -eq "$NODES" ]; then
      echo "local_cluster: nodes $(node_names | tr '\n' ' ')on $HOST up"
      return 0
    fi
    for node in $(echo "$states" | awk '$2 ~ /^(down|drain)/ {print $1}'); do
      scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1
    done
    sleep 1
  done
  die "nodes not idle after 60 s ($(echo "$states" | tr '\n' ' ')); see $LOG_DIR/*.log"
}

start() {
  [ "$(id -u)" -eq 0 ] || die "start needs root"
  check_layout
  install_packages
  start_munge
  map_node_names
  if alive "$RUN_DIR/slurmctld.pid" && ! cmp -s "$CONF" <(conf_text); then
    # another layout is running: restart it, but never under someone's jobs
    wait_for_empty_queue \
      || die "a cluster with another layout runs jobs $(queued_jobs); not restarting it"
    stop_daemons
  fi
  if ! cluster_up; then
    mkdir -p "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" "$SPOOL/ctld"
    conf_text >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  fi
  alive "$RUN_DIR/slurmctld.pid" || /usr/sbin/slurmctld || die "slurmctld did not start"
  local node
  for node in $(node_names); do
    mkdir -p "$SPOOL/d-$node"
    alive "$(slurmd_pid "$node")" || /usr/sbin/slurmd -N "$node" \
      || die "slurmd -N $node did not start; see $LOG_DIR/slurmd-$node.log"
  done
  wait_idle
}

stop_daemons() {  # every slurmd (this layout's, an older one's), slurmctld; munged when asked
  local f
  for f in "$RUN_DIR"/slurmd*.pid "$RUN_DIR/slurmctld.pid" "$@"; do
    if alive "$f"; then
      kill "$(cat "$f")" 2>/dev/null
      for _ in $(seq 1 20); do alive "$f" || break; sleep 0.25; done
    fi
  done
}

stop() {
  if ! wait_for_empty_queue; then
    echo "local_cluster: stopping with jobs still queued: $(queued_jobs)" >&2
  fi
  stop_daemons /run/munge/munged.pid
  echo "local_cluster: stopped"
}

status() {
  command -v sinfo >/dev/null 2>&1 || die "sinfo not installed"
  sinfo || exit 1
  local up
  up=$(sinfo -h -N -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated)$')
  [ "$up" -ge 1 ] && [ "$up" -eq "$(sinfo -h -N -o '%N' 2>/dev/null | wc -l)" ]
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
