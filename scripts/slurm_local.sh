#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for trying `-m hydra/launcher=slurm` and for the tests marked
# `slurm` (tests/test_slurm.py): its own munged, slurmctld and slurmd, every file of theirs under FOLDER.
#
#   sudo scripts/slurm_local.sh start  [FOLDER]   # writes FOLDER/slurm.conf, starts the daemons, waits for the
#                                                 # node to be idle, prints `export SLURM_CONF=FOLDER/slurm.conf`
#   scripts/slurm_local.sh status [FOLDER]        # sinfo and squeue of that cluster (exit 1: not running)
#   sudo scripts/slurm_local.sh stop   [FOLDER]   # cancels its jobs, stops the daemons it started (pid files)
#
# FOLDER defaults to /tmp/ccexp-slurm. The node is this machine (`slurmd -C`: its CPUs and memory), in one
# partition `local` (Default=YES, MaxTime=INFINITE, EnforcePartLimits=ALL: a job asking for more than the
# node has is refused by sbatch); no cgroups (proctrack/linuxproc, task/none); no accounting database
# (sacct does not answer: ccexp's Slurm launcher follows its jobs with squeue), each finished job's state in
# FOLDER/log/jobcomp.txt. Ports: CCEXP_SLURM_PORT (slurmctld, default 6817) and the next one (slurmd). The
# daemons are looked for on PATH and in SLURM_SBIN (default /usr/sbin:/usr/local/sbin). Needs Debian's
# slurm-wlm and munge (apt-get install slurm-wlm munge) and root (slurmd starts jobs as the user who
# submitted them). Start is idempotent: a running cluster is kept. Slurm holds a requeued job about two
# minutes (its BeginTime); `scontrol update JobId=<id> StartTime=now` releases it at once.
set -euo pipefail

ME=slurm_local.sh
die() { echo "$ME: error: $*" >&2; exit 1; }

ACTION=${1:-}
FOLDER=${2:-/tmp/ccexp-slurm}
case "$ACTION" in start|stop|status) ;; *) echo "usage: $ME start|stop|status [FOLDER] (default /tmp/ccexp-slurm)" >&2; exit 2;; esac
PATH=$PATH:${SLURM_SBIN:-/usr/sbin:/usr/local/sbin}  # the daemons (and munged) live in sbin
missing=()
for cmd in slurmctld slurmd munged sinfo squeue sbatch scontrol scancel; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
[ ${#missing[@]} -eq 0 ] || die "Slurm is not installed here (no ${missing[*]}); on Debian or Ubuntu: apt-get install slurm-wlm munge"
if [ "$ACTION" = start ]; then mkdir -p "$FOLDER" 2>/dev/null || die "cannot create $FOLDER"; fi
FOLDER=$(cd "$FOLDER" 2>/dev/null && pwd -P || echo "$FOLDER")
CONF=$FOLDER/slurm.conf
PORT=${CCEXP_SLURM_PORT:-6817}
export SLURM_CONF=$CONF

# the pid in FOLDER/run/NAME.pid when that process is alive and was started with this FOLDER's files
pid_of() {
  local file=$FOLDER/run/$1.pid pid
  [ -s "$file" ] || return 1
  pid=$(tr -dc 0-9 < "$file")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$FOLDER/" || return 1
  echo "$pid"
}

node_state() { sinfo -h -N -n "$NODE" -o %t 2>/dev/null | head -1; }

NODE=$(hostname -s)

status() {
  if ! pid_of slurmctld >/dev/null || ! pid_of slurmd >/dev/null; then
    echo "$ME: no cluster of $FOLDER is running (start one with: sudo scripts/slurm_local.sh start $FOLDER)" >&2
    return 1
  fi
  echo "export SLURM_CONF=$CONF"
  sinfo
  squeue
}

# the processes of this cluster's job steps: each slurmstepd started by its slurmd (whose environment names this
# folder's slurm.conf: another cluster on this machine is left alone) and everything below it (pid per line)
job_processes() {
  local queue="" pid child
  for pid in $(pgrep -f '^slurmstepd' 2>/dev/null || true); do
    tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_CONF=$FOLDER/slurm.conf" && queue="$queue $pid"
  done
  while [ -n "$queue" ]; do
    set -- $queue; pid=$1; shift; queue="$*"
    echo "$pid"
    for child in $(pgrep -P "$pid" 2>/dev/null || true); do queue="$queue $child"; done
  done
}

stop() {
  if pid_of slurmctld >/dev/null; then  # its jobs first, so no job step outlives the daemons
    scancel --quiet --full --partition=local 2>/dev/null || true
    # a job may take its time after SIGTERM (ccexp finishes its step and saves a checkpoint); slurmd sends SIGKILL
    # after KillWait (30 s, slurm.conf): wait that long and a little more for the queue to empty
    for _ in $(seq 1 80); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && [ -z "$(job_processes)" ] && break
      sleep 0.5
    done
  fi
  local left
  left=$(job_processes | tr '\n' ' ')
  if [ -n "$left" ]; then  # what outlived its job's cancellation: killed before its daemons go, never orphaned
    kill -KILL $left 2>/dev/null || true
    sleep 1
  fi
  local stopped=()
  for name in slurmd slurmctld munged; do
    local pid
    pid=$(pid_of "$name") || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    rm -f "$FOLDER/run/$name.pid"
    stopped+=("$name ($pid)")
  done
  if [ ${#stopped[@]} -eq 0 ]; then
    echo "$ME: nothing of $FOLDER was running"
  else
    echo "$ME: stopped ${stopped[*]}${left:+; killed job processes that outlived their job: $left}"
  fi
  left=$(job_processes | tr '\n' ' ')
  if [ -n "$left" ]; then
    echo "$ME: job processes still running after stop: $left" >&2
    exit 1
  fi
}

write_conf() {
  local hw
  hw=$(slurmd -C | head -1)  # NodeName=<host> CPUs=.. Boards=.. SocketsPerBoard=.. CoresPerSocket=.. ThreadsPerCore=.. RealMemory=..
  mkdir -p "$FOLDER"/{run,log,state,spool/slurmd,munge}
  chmod 755 "$FOLDER" "$FOLDER"/{run,log,spool,munge}  # munge/: the socket, for every user of this machine
  chmod 700 "$FOLDER/state"
  : > "$FOLDER/plugstack.conf"
  cat > "$CONF.tmp" <<EOF
# written by scripts/slurm_local.sh: a one-node cluster on $NODE, every file under $FOLDER
ClusterName=ccexp-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$FOLDER/munge/munge.socket
StateSaveLocation=$FOLDER/state
SlurmdSpoolDir=$FOLDER/spool/slurmd
SlurmctldPidFile=$FOLDER/run/slurmctld.pid
SlurmdPidFile=$FOLDER/run/slurmd.pid
SlurmctldLogFile=$FOLDER/log/slurmctld.log
SlurmdLogFile=$FOLDER/log/slurmd.log
PlugStackConfig=$FOLDER/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$FOLDER/log/jobcomp.txt
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/backfill
ReturnToService=2
EnforcePartLimits=ALL
JobRequeue=1
KillWait=30
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=120
$hw
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  sed -i "s/^NodeName=\S*/NodeName=$NODE NodeAddr=127.0.0.1/" "$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
  chmod 644 "$CONF"
}

start_munge() {
  pid_of munged >/dev/null && return 0
  local key=$FOLDER/munge/munge.key
  if [ ! -s "$key" ]; then  # the machine's key when there is one, else a new one; a copy owned by root either way
    if [ -r /etc/munge/munge.key ]; then
      cp /etc/munge/munge.key "$key.tmp"
    else
      dd if=/dev/urandom of="$key.tmp" bs=1024 count=1 status=none
    fi
    chmod 600 "$key.tmp" && mv "$key.tmp" "$key"
  fi
  rm -f "$FOLDER/munge/munge.socket" "$FOLDER/munge/munge.socket.lock"
  munged --force --key-file="$key" --socket="$FOLDER/munge/munge.socket" --pid-file="$FOLDER/run/munged.pid" \
    --log-file="$FOLDER/log/munged.log" --seed-file="$FOLDER/munge/munged.seed" \
    || die "munged did not start; see $FOLDER/log/munged.log"
}

start() {
  [ "$(id -u)" = 0 ] || die "start needs root (slurmd starts each job as the user who submitted it): sudo $0 start $FOLDER"
  if pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null && pid_of munged >/dev/null; then
    echo "$ME: the cluster of $FOLDER is already running"
  else
    for port in $PORT $((PORT + 1)); do  # slurmctld's and slurmd's, unless they are this cluster's own
      if ! pid_of slurmctld >/dev/null && ! pid_of slurmd >/dev/null && command -v ss >/dev/null \
          && ss -ltn "sport = :$port" | grep -q LISTEN; then
        die "port $port is in use by another program; choose other ports with CCEXP_SLURM_PORT=<port> $0 start $FOLDER"
      fi
    done
    pid_of slurmctld >/dev/null || pid_of slurmd >/dev/null || write_conf
    start_munge
    pid_of slurmctld >/dev/null || slurmctld -f "$CONF" || die "slurmctld did not start; see $FOLDER/log/slurmctld.log"
    pid_of slurmd >/dev/null || slurmd -f "$CONF" -N "$NODE" || die "slurmd did not start; see $FOLDER/log/slurmd.log"
  fi
  local state="" waited=0 limit=${CCEXP_SLURM_WAIT_S:-60}
  while [ "$waited" -lt "$limit" ]; do
    state=$(node_state || true)
    case "$state" in idle|mix|alloc) break;; esac
    sleep 1
    waited=$((waited + 1))
  done
  case "$state" in
    idle|mix|alloc) ;;
    *) die "node $NODE is not idle after ${limit} s (sinfo: ${state:-no answer}); see $FOLDER/log/slurmctld.log and slurmd.log";;
  esac
  echo "$ME: node $NODE is $state ($(sinfo -h -N -n "$NODE" -o '%c CPUs, %m MB')), partition local"
  echo "export SLURM_CONF=$CONF"
}

"$ACTION"
