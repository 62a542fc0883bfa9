#!/bin/bash
# A single-node SLURM cluster on this machine, for tests/host/test_slurm.py.
#
# Run as root. Idempotent: a second run leaves a working cluster alone and
# only (re)starts what is missing. Needs Debian's `slurm-wlm` and `munge`
# packages (.ci/run installs them). Starts the daemons directly (munged,
# slurmctld, slurmd), without systemd, so it works in CI containers too.
#
# Nothing leaves the machine: munged listens on a unix socket only; every
# address in slurm.conf is 127.0.0.1, so no daemon or client ever sends to
# another host; CommunicationParameters=NoInAddrAny makes slurmd and the
# clients bind to 127.0.0.1. slurmctld is the exception Slurm allows no
# choice about: it listens on every address of port 6817 (the option does
# not apply to it), and answers only requests signed with this machine's
# munge key.
#
# It refuses to replace an /etc/slurm/slurm.conf it did not write (a real
# cluster's); NSBOX_SLURM_FORCE=1 overrides that.
#
# `setup.sh --stop` stops the three daemons again (and leaves the files).
#
# Environment: NSBOX_SLURM_WAIT (seconds to wait for the node, default 60).
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

conf=/etc/slurm/slurm.conf
marker="# Written by nsbox tests/slurm/setup.sh"
wait_s=${NSBOX_SLURM_WAIT:-60}
logdir=/var/log/slurm
say() { printf 'slurm setup: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (it writes /etc/slurm/slurm.conf and starts the daemons)"
for cmd in munged munge unmunge slurmctld slurmd sinfo scontrol; do
    command -v "$cmd" >/dev/null || die "$cmd is missing: apt-get install slurm-wlm munge"
done
getent passwd slurm >/dev/null || die "user 'slurm' is missing (the slurm-wlm package creates it)"
getent passwd munge >/dev/null || die "user 'munge' is missing (the munge package creates it)"

# A daemon of ours is running if its pid file names a live process of that
# name.
running() {  # NAME PIDFILE
    local pid
    pid=$(cat "$2" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]]
}
stop() {  # NAME PIDFILE WHY: SIGTERM, bounded wait
    running "$1" "$2" || return 0
    local pid
    pid=$(cat "$2")
    say "stopping $1 (pid $pid)$3"
    kill "$pid"
    for _ in $(seq 100); do [[ -d /proc/$pid ]] || return 0; sleep 0.1; done
    die "$1 (pid $pid) did not stop"
}
if [[ ${1:-} == --stop ]]; then
    stop slurmd /run/slurmd.pid ""
    stop slurmctld /run/slurmctld.pid ""
    stop munged /run/munge/munged.pid ""
    exit 0
fi

# ---- munge: the credentials every Slurm message carries -----------------
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    else
        (umask 077; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none)
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_works; then
    say "starting munged"
    rm -f /run/munge/munged.pid  # stale after a reboot or a killed daemon
    runuser -u munge -- munged --force  # --force: reuse a stale socket
    for _ in $(seq 50); do munge_works && break; sleep 0.1; done
    munge_works || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# ---- slurm.conf ----------------------------------------------------------
host=$(hostname -s)
# This node as slurmd sees it (CPUs, sockets, cores, threads), so that its
# registration matches; RealMemory from /proc/meminfo minus a margin (5 %,
# at least 256 MiB): a node configured with more memory than it reports is
# refused.
hw=$(slurmd -C | head -n1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
[[ $hw == *CPUs=* ]] || die "slurmd -C did not describe this node: $(slurmd -C 2>&1 | head -n3)"
mem_mb=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
margin=$((mem_mb / 20 > 256 ? mem_mb / 20 : 256))
real_mem=$((mem_mb - margin))

new=$(mktemp)
trap 'rm -f "$new"' EXIT
cat >"$new" <<EOF
$marker: a single-node cluster on localhost.
ClusterName=nsbox-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
# slurmd and clients bind to the node's address (127.0.0.1) instead of any.
CommunicationParameters=NoInAddrAny
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$logdir/slurmctld.log
SlurmdLogFile=$logdir/slurmd.log
# No cgroup plugins: hosts without a delegated cgroup tree (cgroup v1 here)
# must work. Processes are tracked through their parent pids.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node that was down comes back when it registers with a valid config.
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host ${hw}RealMemory=$real_mem State=UNKNOWN
PartitionName=nsbox Nodes=$host Default=YES MaxTime=60 State=UP
EOF

install -d -m 0755 /etc/slurm
changed=0
if ! cmp -s "$new" "$conf"; then
    if [[ -e $conf ]] && ! head -n1 "$conf" | grep -qF "$marker" && [[ ${NSBOX_SLURM_FORCE:-} != 1 ]]; then
        die "$conf exists and was not written by this script; refusing to replace it (NSBOX_SLURM_FORCE=1 to do it anyway)"
    fi
    say "writing $conf"
    install -m 0644 "$new" "$conf"
    changed=1
fi
# Nothing in it may point off this machine.
if grep -E '[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+' "$conf" | grep -vqE '127\.0\.0\.1'; then
    die "$conf names a non-loopback address"
fi

install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld "$logdir"
install -d -o root -g root -m 0755 /var/spool/slurmd

# ---- the daemons ---------------------------------------------------------
# After a config change they are restarted.
if [[ $changed == 1 ]]; then
    stop slurmd /run/slurmd.pid ": the configuration changed"
    stop slurmctld /run/slurmctld.pid ": the configuration changed"
fi
if ! running slurmctld /run/slurmctld.pid; then
    say "starting slurmctld"
    slurmctld || die "slurmctld failed to start (see $logdir/slurmctld.log)"
fi
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer (see $logdir/slurmctld.log)"
if ! running slurmd /run/slurmd.pid; then
    say "starting slurmd"
    slurmd || die "slurmd failed to start (see $logdir/slurmd.log)"
fi

# ---- wait for the node ---------------------------------------------------
deadline=$((SECONDS + wait_s))
resumed=0
while :; do
    state=$(sinfo -h -N -n "$host" -o '%T' 2>/dev/null | head -n1)
    case $state in
        idle | mixed | allocated | completing) break ;;
        drained | draining | down | "down*" | drain*)
            # Left over from an earlier run (a daemon killed mid-job, say).
            if [[ $resumed == 0 && $state != "down*" ]]; then
                say "node $host is $state: resuming it"
                scontrol update NodeName="$host" State=RESUME || true
                resumed=1
            fi ;;
    esac
    if ((SECONDS >= deadline)); then
        reason=$(sinfo -h -N -n "$host" -o '%E' 2>/dev/null | head -n1)
        die "node $host is '${state:-unknown}' (${reason:-no reason given}) after ${wait_s}s, not idle; see $logdir/slurmd.log and $logdir/slurmctld.log"
    fi
    sleep 0.2
done
say "node $host is $state (partition nsbox, $(echo "$hw" | tr ' ' '\n' | grep '^CPUs='), RealMemory=${real_mem}M)"
