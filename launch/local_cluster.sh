#!/usr/bin/env bash
# A real SLURM cluster of two fake nodes (node1, node2) on this host, for tests and for trying the
# launchers without a cluster. Needs root (daemons run as root, /etc/slurm is written).
#
#   launch/local_cluster.sh install   # Debian slurmctld slurmd slurm-client munge, if absent
#   launch/local_cluster.sh start     # write slurm.conf, start munged, slurmctld, two slurmd
#   launch/local_cluster.sh status    # health: munge round trip, scontrol ping, node states
#   launch/local_cluster.sh stop      # stop every daemon it started, SIGKILL after a timeout
#
# Every command is idempotent and every wait is bounded. Exit status 3 means "cannot install here"
# (not root, or no apt-get), which callers may treat as a skip rather than a failure.
set -euo pipefail

STATE=${MSA_SLURM_STATE:-/var/tmp/msa-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# written by msa launch/local_cluster.sh"
NODES=(node1 node2)
START_TIMEOUT=${MSA_SLURM_START_TIMEOUT:-30}
STOP_TIMEOUT=${MSA_SLURM_STOP_TIMEOUT:-15}

log() { echo "[local_cluster] $*" >&2; }
die() { log "error: $*"; exit "${2:-1}"; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND until it succeeds or time runs out
wait_for() {
    local timeout=$1 what=$2; shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "timed out after ${timeout}s waiting for: $what"
            return 1
        fi
        sleep 0.5
    done
}

# a process counts as alive unless it is gone or a zombie (zombies linger without an init reaper)
alive() {
    local pid=$1 state
    [[ -r /proc/$pid/stat ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z && $state != X ]]
}

have_binaries() {
    command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged && command -v unmunge
}

cmd_install() {
    if have_binaries >/dev/null; then
        log "slurm and munge already installed"
        return 0
    fi
    [[ $(id -u) -eq 0 ]] || die "installing slurm needs root" 3
    command -v apt-get >/dev/null || die "apt-get not found; install slurmctld slurmd slurm-client munge by hand" 3
    log "installing slurmctld slurmd slurm-client munge"
    # the packages try to start their services; without an init system that is refused, harmlessly
    timeout 300 apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null || die "apt-get install failed"
    have_binaries >/dev/null || die "slurm binaries missing after install"
}

write_conf() {
    if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to overwrite a real cluster's config"
    fi
    local host cpus
    host=$(hostname -s)
    # each fake node claims the host's cores; with CR_CPU a 1-task-per-node job takes one of them
    cpus=$(nproc)
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/log"
    for n in "${NODES[@]}"; do mkdir -p "$STATE/slurmd/$n"; done
    cat >"$CONF.tmp" <<EOF
$MARKER
ClusterName=msa-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 Port=17001 CPUs=$cpus State=UNKNOWN
NodeName=node2 NodeHostname=$host NodeAddr=127.0.0.1 Port=17002 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
    # jobs resolve MASTER_ADDR=node1 through /etc/hosts
    if ! grep -qE '^127\.0\.0\.1[[:space:]].*\bnode1\b.*\bnode2\b' /etc/hosts; then
        echo "127.0.0.1 node1 node2" >>/etc/hosts
    fi
    # the daemons look their own host up; containers do not always list it
    getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >>/etc/hosts
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then
        return 0
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key missing (reinstall munge)"
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    runuser -u munge -- /usr/sbin/munged --pid-file="/run/munge/munged.pid"
    # stop only tears down a munged that this script started
    cp /run/munge/munged.pid "$STATE/munged.pid" 2>/dev/null || true
    wait_for "$START_TIMEOUT" "munge round trip" munge_ok
}

pid_of() { [[ -s $1 ]] && cat "$1"; }

ctld_ok() { scontrol ping 2>/dev/null | grep -q "UP"; }

nodes_idle() {
    local states
    states=$(sinfo -h -N -o "%N %t" 2>/dev/null) || return 1
    for n in "${NODES[@]}"; do
        grep -qE "^$n (idle|mix|alloc)" <<<"$states" || return 1
    done
}

cmd_start() {
    have_binaries >/dev/null || die "slurm is not installed; run: $0 install"
    [[ $(id -u) -eq 0 ]] || die "starting the local cluster needs root"
    mkdir -p "$STATE"
    write_conf
    start_munge
    local pid
    pid=$(pid_of "$STATE/slurmctld.pid" || true)
    if [[ -z $pid ]] || ! alive "$pid"; then
        # -c: start from a clean state, jobs of an earlier session are forgotten
        slurmctld -c
    fi
    wait_for "$START_TIMEOUT" "scontrol ping" ctld_ok || { tail -n 20 "$STATE/log/slurmctld.log" >&2; exit 1; }
    for n in "${NODES[@]}"; do
        pid=$(pid_of "$STATE/slurmd-$n.pid" || true)
        if [[ -z $pid ]] || ! alive "$pid"; then
            slurmd -N "$n"
        fi
    done
    # nodes left down by an earlier crash come back with ReturnToService=2; nudge them anyway
    for n in "${NODES[@]}"; do
        if sinfo -h -n "$n" -o "%t" 2>/dev/null | grep -qE "down|drain"; then
            scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
        fi
    done
    wait_for "$START_TIMEOUT" "nodes idle" nodes_idle || { sinfo -N >&2 || true; tail -n 20 "$STATE"/log/slurmd-*.log >&2; exit 1; }
    log "cluster up: $(sinfo -h -N -o '%N=%t' | tr '\n' ' ')"
}

# stop_pidfile FILE NAME: SIGTERM, bounded wait, SIGKILL
stop_pidfile() {
    local file=$1 name=$2 pid
    pid=$(pid_of "$file" || true)
    if [[ -n $pid ]] && alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        if ! wait_for "$STOP_TIMEOUT" "$name to exit" bash -c "! { [[ -r /proc/$pid/stat ]] && awk '{exit (\$3==\"Z\")}' /proc/$pid/stat; }"; then
            log "$name ($pid) ignored SIGTERM; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            wait_for 5 "$name to die" bash -c "! { [[ -r /proc/$pid/stat ]] && awk '{exit (\$3==\"Z\")}' /proc/$pid/stat; }" || true
        fi
    fi
    rm -f "$file"
}

# slurm daemons still alive on this host (pid and name), zombies excluded
leftover_daemons() {
    local p comm
    for p in /proc/[0-9]*; do
        comm=$(cat "$p/comm" 2>/dev/null) || continue
        case $comm in
            slurmctld | slurmd | slurmstepd) alive "${p#/proc/}" && echo "${p#/proc/} $comm" ;;
        esac
    done
    return 0
}

cmd_stop() {
    # cancel jobs first so no slurmstepd outlives its slurmd
    if ctld_ok; then
        scancel --quiet --full --signal=KILL --state=RUNNING "--user=$(id -un)" 2>/dev/null || true
        scancel --quiet "--user=$(id -un)" 2>/dev/null || true
    fi
    for n in "${NODES[@]}"; do stop_pidfile "$STATE/slurmd-$n.pid" "slurmd $n"; done
    stop_pidfile "$STATE/slurmctld.pid" slurmctld
    # step daemons of killed jobs exit on their own shortly; give them a bounded moment
    local rest
    local deadline=$((SECONDS + STOP_TIMEOUT))
    while rest=$(leftover_daemons) && [[ -n $rest ]] && ((SECONDS < deadline)); do sleep 0.5; done
    if [[ -n $rest ]]; then
        log "killing leftover slurm processes: $(tr '\n' ' ' <<<"$rest")"
        awk '{print $1}' <<<"$rest" | xargs -r kill -KILL 2>/dev/null || true
        sleep 0.5
    fi
    [[ -s $STATE/munged.pid ]] && stop_pidfile "$STATE/munged.pid" munged
    rest=$(leftover_daemons)
    [[ -z $rest ]] || die "slurm processes remain: $rest"
    log "stopped"
}

cmd_status() {
    local ok=0
    if munge_ok; then log "munge: ok"; else log "munge: DOWN"; ok=1; fi
    if ctld_ok; then log "slurmctld: $(scontrol ping | tr -s ' ')"; else log "slurmctld: DOWN"; ok=1; fi
    if ((ok == 0)); then
        sinfo -N -o "%N %P %t %c" >&2 || true
        nodes_idle || { log "nodes not all up"; ok=1; }
    fi
    return $ok
}

case ${1:-} in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 {install|start|stop|status}" >&2; exit 2 ;;
esac
