#!/usr/bin/env bash
# A real SLURM cluster of two fake nodes (node1, node2) on this host, for tests and for trying the
# launchers without a cluster. Needs root (daemons run as root).
#
#   launch/local_cluster.sh install   # Debian slurmctld slurmd slurm-client munge, if absent
#   launch/local_cluster.sh start     # write the config, start munged, slurmctld, two slurmd
#   launch/local_cluster.sh env       # the line to use it from a shell: eval "$(... env)"
#   launch/local_cluster.sh status    # health: munge round trip, scontrol ping, node states
#   launch/local_cluster.sh stop      # cancel its jobs, stop the daemons it started
#
# Several clusters can run side by side on one host: each lives in its own state directory
# (MSA_SLURM_STATE, default /var/tmp/msa-slurm) with its own slurm.conf, munged socket and ports
# (MSA_SLURM_PORT: slurmctld; the two slurmd use the next two ports). Each fake node offers the
# host's cores (MSA_SLURM_CPUS to offer more; with CR_CPU a 1-task-per-node job takes one of them).
# Nothing is written to
# /etc/slurm, so clients find the cluster through SLURM_CONF=<state>/slurm.conf (`env` prints it).
# `stop` signals only the processes this cluster started (pid files in the state directory) and
# the step daemons of its own jobs. The only file touched outside the state directory is
# /etc/hosts, which gets node1 and node2 (and the host's own name) once if they do not resolve.
#
# Every command is idempotent and every wait is bounded. Exit status 3 means "cannot install here"
# (not root, or no apt-get), which callers may treat as a skip rather than a failure.
set -euo pipefail

STATE=${MSA_SLURM_STATE:-/var/tmp/msa-slurm}
PORT=${MSA_SLURM_PORT:-16817}
CONF=$STATE/slurm.conf
MUNGE_DIR=$STATE/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
NODES=(node1 node2)
START_TIMEOUT=${MSA_SLURM_START_TIMEOUT:-30}
STOP_TIMEOUT=${MSA_SLURM_STOP_TIMEOUT:-15}
# how long SLURM holds a requeued job before it may start again (AuthInfo cred_expire; SLURM's
# default is 120 s, which would make every requeue in the tests wait two minutes)
REQUEUE_DELAY=${MSA_SLURM_REQUEUE_DELAY:-10}
# seconds between SIGTERM and SIGKILL when a job ends (scancel, requeue, time limit)
KILL_WAIT=${MSA_SLURM_KILL_WAIT:-30}
# CPUs each fake node offers (default: the host's); more than the host lets jobs share cores
CPUS=${MSA_SLURM_CPUS:-$(nproc)}
export SLURM_CONF=$CONF

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
        sleep 0.2
    done
}

# a process counts as alive unless it is gone or a zombie (zombies linger without an init reaper)
alive() {
    local pid=$1 state
    [[ -r /proc/$pid/stat ]] || return 1
    state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ -n $state && $state != Z && $state != X ]]
}
dead() { ! alive "$1"; }

# the pid in FILE if that process is alive and is the program NAME (a recycled pid is not ours)
live_pid() {
    local file=$1 name=$2 pid
    [[ -s $file ]] || return 1
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    echo "$pid"
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

# add_hosts NAME...: one line "127.0.0.1 NAME..." for the names that do not resolve yet
add_hosts() {
    local missing=() n
    for n in "$@"; do getent hosts "$n" >/dev/null || missing+=("$n"); done
    ((${#missing[@]} == 0)) || echo "127.0.0.1 ${missing[*]}" >>/etc/hosts
}

write_conf() {
    local host
    host=$(hostname -s)
    mkdir -p "$STATE/ctld" "$STATE/log"
    for n in "${NODES[@]}"; do mkdir -p "$STATE/slurmd/$n"; done
    cat >"$CONF.tmp" <<EOF
# written by launch/local_cluster.sh (state $STATE)
ClusterName=msa$PORT
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$REQUEUE_DELAY
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
# nodes may offer more CPUs than the host has (MSA_SLURM_CPUS)
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=$KILL_WAIT
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS State=UNKNOWN
NodeName=node2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
    # jobs resolve MASTER_ADDR=node1 through /etc/hosts; the daemons look their own host up
    add_hosts "${NODES[@]}" "$host"
}

munge_ok() { munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

start_munge() {
    if live_pid "$MUNGE_DIR/munged.pid" munged >/dev/null && munge_ok; then
        return 0
    fi
    [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key missing (reinstall munge)"
    # munged refuses directories others may write to; it runs as the munge user
    mkdir -p "$MUNGE_DIR"
    chown munge:munge "$MUNGE_DIR"
    chmod 0755 "$MUNGE_DIR"
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" --pid-file="$MUNGE_DIR/munged.pid" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" \
        || die "munged did not start: $(tail -n 3 "$MUNGE_DIR/munged.log" 2>/dev/null)"
    wait_for "$START_TIMEOUT" "munge round trip" munge_ok
}

ctld_ok() { scontrol ping 2>/dev/null | grep -q "UP"; }

nodes_idle() {
    local states
    states=$(sinfo -h -N -o "%N %t" 2>/dev/null) || return 1
    for n in "${NODES[@]}"; do
        grep -qE "^$n (idle|mix|alloc)" <<<"$states" || return 1
    done
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cmd_start() {
    have_binaries >/dev/null || die "slurm is not installed; run: $0 install"
    [[ $(id -u) -eq 0 ]] || die "starting the local cluster needs root"
    [[ $PORT =~ ^[0-9]+$ ]] && ((PORT > 1024 && PORT < 65534)) || die "MSA_SLURM_PORT=$PORT is not a usable port"
    mkdir -p "$STATE"
    chmod 0755 "$STATE"
    local pid
    if ! live_pid "$STATE/slurmctld.pid" slurmctld >/dev/null; then
        local p
        for p in "$PORT" $((PORT + 1)) $((PORT + 2)); do
            port_in_use "$p" && die "port $p is in use (another cluster?); choose MSA_SLURM_PORT"
        done
    fi
    write_conf
    start_munge
    if ! live_pid "$STATE/slurmctld.pid" slurmctld >/dev/null; then
        # -c: start from a clean state, jobs of an earlier session are forgotten
        slurmctld -c -f "$CONF"
    fi
    wait_for "$START_TIMEOUT" "scontrol ping" ctld_ok || { tail -n 20 "$STATE/log/slurmctld.log" >&2; exit 1; }
    for n in "${NODES[@]}"; do
        if ! live_pid "$STATE/slurmd-$n.pid" slurmd >/dev/null; then
            slurmd -f "$CONF" -N "$n"
        fi
    done
    # nodes left down by an earlier crash come back with ReturnToService=2; nudge them anyway
    for n in "${NODES[@]}"; do
        if sinfo -h -n "$n" -o "%t" 2>/dev/null | grep -qE "down|drain"; then
            scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
        fi
    done
    wait_for "$START_TIMEOUT" "nodes idle" nodes_idle || { sinfo -N >&2 || true; tail -n 20 "$STATE"/log/slurmd-*.log >&2; exit 1; }
    log "cluster up: $(sinfo -h -N -o '%N=%t' | tr '\n' ' ')(SLURM_CONF=$CONF)"
}

# stop_pid PID NAME: SIGTERM, bounded wait, SIGKILL
stop_pid() {
    local pid=$1 name=$2
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_for "$STOP_TIMEOUT" "$name to exit" dead "$pid"; then
        log "$name ($pid) ignored SIGTERM; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        wait_for 5 "$name to die" dead "$pid" || true
    fi
}

# stop_pidfile FILE NAME: stop the process named in FILE if it is still ours
stop_pidfile() {
    local file=$1 name=$2 pid
    if pid=$(live_pid "$file" "$name"); then
        stop_pid "$pid" "$name"
    fi
    rm -f "$file"
}

# step daemons of this cluster's jobs: a slurmstepd keeps the working directory of the slurmd
# that started it, which is inside the state directory
our_stepds() {
    local p
    for p in /proc/[0-9]*; do
        [[ $(cat "$p/comm" 2>/dev/null) == slurmstepd ]] || continue
        [[ $(readlink "$p/cwd" 2>/dev/null) == "$STATE"/* ]] || continue
        alive "${p#/proc/}" && echo "${p#/proc/}"
    done
    return 0
}

cmd_stop() {
    [[ -d $STATE ]] || { log "no cluster in $STATE"; return 0; }
    # cancel jobs first so no slurmstepd outlives its slurmd; every job of this cluster is ours
    if [[ -f $CONF ]] && ctld_ok; then
        scancel --quiet --full --signal=KILL --state=RUNNING 2>/dev/null || true
        scancel --quiet 2>/dev/null || true
    fi
    for n in "${NODES[@]}"; do stop_pidfile "$STATE/slurmd-$n.pid" slurmd; done
    stop_pidfile "$STATE/slurmctld.pid" slurmctld
    # step daemons of killed jobs exit on their own shortly; give them a bounded moment
    local rest
    local deadline=$((SECONDS + STOP_TIMEOUT))
    while rest=$(our_stepds) && [[ -n $rest ]] && ((SECONDS < deadline)); do sleep 0.2; done
    if [[ -n $rest ]]; then
        log "killing leftover step daemons: $(tr '\n' ' ' <<<"$rest")"
        xargs -r kill -KILL <<<"$rest" 2>/dev/null || true
        sleep 0.5
    fi
    stop_pidfile "$MUNGE_DIR/munged.pid" munged
    rest=$(our_stepds)
    [[ -z $rest ]] || die "step daemons remain: $rest"
    log "stopped"
}

cmd_status() {
    local ok=0
    [[ -f $CONF ]] || die "no cluster in $STATE (start it first)"
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
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 {install|start|env|status|stop}" >&2; exit 2 ;;
esac
