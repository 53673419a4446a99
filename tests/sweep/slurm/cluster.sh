#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for tests/sweep/slurm/test_slurm.py (and by hand):
#
#   tests/sweep/slurm/cluster.sh install        # apt-get install slurm-wlm munge when missing (root)
#   tests/sweep/slurm/cluster.sh start DIR      # munged, slurmctld, slurmd with their state under DIR
#   export SLURM_CONF=DIR/slurm.conf      # then sbatch, squeue, scontrol use it
#   tests/sweep/slurm/cluster.sh stop DIR       # stops the daemons this script started (by their pid files)
#
# The node has this machine's CPUs and memory; one partition, "debug". Nothing is written outside
# DIR except munged's socket, which Slurm's munge plugin looks for in its default place.
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
mkdir -p /run/munge
munged --force --key-file="$dir/munge/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
    --socket=/run/munge/munge.socket.2

cat >"$dir/slurm.conf" <<EOF
ClusterName=effitrain-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
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
