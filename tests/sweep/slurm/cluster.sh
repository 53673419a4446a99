#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for tests/sweep/slurm/test_slurm.py (and by hand):
#
#   tests/sweep/slurm/cluster.sh install        # apt-get install slurm-wlm munge when missing (root)
#   tests/sweep/slurm/cluster.sh start DIR      # munged, slurmctld, slurmd with their state under DIR
#   export SLURM_CONF=DIR/slurm.conf      # then sbatch, squeue, scontrol use it
#   tests/sweep/slurm/cluster.sh stop DIR       # stops the daemons this script started (by their pid files)
#
# The node has this machine's CPUs and memory; one partition, "debug". Nothing is written outside
# DIR, munged's socket included, and the daemons listen on ports free at start: two checkouts' tests
# on one machine each get their own cluster, never one another's jobs.
set -euo pipefail

command=${1:?usage: cluster.sh install|start DIR|stop DIR}

if [[ $command == install ]]; then
    if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null; then
        exit 0
    fi
    if [[ $(id -u) != 0 ]]; then
        echo "cluster.sh: slurm-wlm and munge are not installed and this is not root" >&2
        exit 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q slurm-wlm munge >/dev/null
    exit 0
fi

dir=${2:?usage: cluster.sh start|stop DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

if [[ $command == stop ]]; then
    if [[ -f $dir/slurm.conf ]]; then
        SLURM_CONF=$dir/slurm.conf scontrol shutdown >/dev/null 2>&1 || true
    fi
    for name in slurmd slurmctld munged; do
        pidfile=$dir/$name.pid
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            kill "$pid" 2>/dev/null || true
            sleep 0.2
        done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
    exit 0
fi

[[ $command == start ]] || { echo "cluster.sh: unknown command $command" >&2; exit 2; }

node=$(hostname -s)
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours OMP_NUM_THREADS, which the tests set per worker
memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
user=$(id -un)
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"

# munged: its own key and log under DIR; the socket where Slurm expects it
if [[ ! -f $dir/munge/munge.key ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none
    chmod 400 "$dir/munge/munge.key"
fi
munged --force --key-file="$dir/munge/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
    --socket="$dir/munge/munge.socket"
read -r ctld_port slurmd_port < <(python3 -c '
import socket
sockets = [socket.socket() for _ in range(2)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))')

cat >"$dir/slurm.conf" <<EOF
ClusterName=effitrain-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
# cred_expire (default 120 s) is also how long a requeued job waits before it may start again, and
# only the main scheduler's full pass (sched_interval, 60 s by default) starts it then: the requeue
# test sat idle for over two minutes. 10 s still gives a loaded machine time to launch a step on its
# credential; a pass a second costs nothing with a job or two.
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
SchedulerParameters=sched_interval=1
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
: >"$dir/cgroup.conf"

export SLURM_CONF=$dir/slurm.conf
slurmctld -i -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"

for _ in $(seq 60); do
    if sinfo -h -N -o "%T" 2>/dev/null | grep -q -E "^idle"; then
        echo "cluster.sh: SLURM up on $node ($cpus CPUs, $memory_mb MB): export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "cluster.sh: the node did not become idle; see $dir/slurmctld.log and $dir/slurmd.log" >&2
sinfo -N >&2 || true
exit 1
