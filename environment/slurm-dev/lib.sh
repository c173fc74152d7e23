# shellcheck shell=bash disable=SC2034
# Shared by up.sh and down.sh (sourced, not executed).
# Everything the dev cluster owns lives under $STATE; the few things it has to
# put elsewhere (/etc/slurm/slurm.conf, /etc/hosts lines, network namespaces,
# a bridge) are recorded under $STATE/owned/ and carry the $MARK comment.

STATE=${HPC_TOOLS_SLURM_STATE:-/var/tmp/hpc-tools-slurm}
MARK="hpc-tools-slurm-dev"            # tag on lines/files we write outside $STATE
SLURM_CONF_PATH=/etc/slurm/slurm.conf # Debian's compiled-in default: clients, submitit and tests find it with no env var
# A SLURM_CONF inherited from the caller would send our daemons and clients elsewhere.
export SLURM_CONF=$SLURM_CONF_PATH
CLUSTER_NAME=hpctools
SUBNET=${HPC_TOOLS_SLURM_SUBNET:-10.77.0}   # private /24, exists only on this machine (multi-node mode)
BRIDGE=hpcslurm0
NS_PREFIX=hpcslurm-                          # network namespace = $NS_PREFIX<node>
NODE_PREFIX=${HPC_TOOLS_SLURM_NODE_PREFIX:-n}
DB_PORT=${HPC_TOOLS_SLURM_DB_PORT:-13306}    # MariaDB, 127.0.0.1 only; not 3306 so a system MariaDB is left alone

PIDS_DIR=$STATE/pids      # one file per daemon we started: "<pid> <comm>"
OWNED_DIR=$STATE/owned    # things outside $STATE that down.sh must undo
LOG_DIR=$STATE/log

say() { printf '[slurm-dev] %s\n' "$*"; }
warn() { printf '[slurm-dev] WARNING: %s\n' "$*" >&2; }

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# pid_alive PIDFILE: true when the process recorded in PIDFILE still runs and is
# still the same program (guards against pid reuse after a reboot/container restart).
pid_alive() {
    local pid comm
    read -r pid comm <"$1" 2>/dev/null || return 1
    [[ -n ${pid:-} && -r /proc/$pid/comm ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]]
}

# wait_until TIMEOUT_S CMD...: poll CMD (quietly) every 0.2 s. On timeout, the last
# output of CMD is left in WAIT_LAST (for the error message).
WAIT_LAST=""
wait_until() {
    local timeout=$1; shift
    local end=$(($(date +%s) + timeout))
    until WAIT_LAST=$("$@" 2>&1); do
        (($(date +%s) < end)) || return 1
        sleep 0.2
    done
    WAIT_LAST=""
}

# Remove the lines carrying $MARK from /etc/hosts. Rewritten in place (cat >) rather
# than sed -i, because /etc/hosts is often a bind mount in containers (rename fails).
hosts_remove_marked() {
    [[ -f /etc/hosts ]] && grep -q "$MARK" /etc/hosts || return 0
    local tmp
    tmp=$(mktemp)
    grep -v "$MARK" /etc/hosts >"$tmp" || true
    cat "$tmp" >/etc/hosts
    rm -f "$tmp"
}
