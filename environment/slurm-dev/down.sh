#!/usr/bin/env bash
# shellcheck disable=SC2317  # the steps are called through "$step" in main
# Stop the dev Slurm cluster that up.sh started, and undo what it changed outside
# its state dir. Only touches what up.sh recorded (pids in $STATE/pids, the
# namespaces/bridge/hosts lines/slurm.conf in $STATE/owned). Safe to run twice, or
# with no cluster up: always exits 0.
#
#   bash environment/slurm-dev/down.sh
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

# Cancel jobs first, so slurmd/slurmstepd get to kill the job processes
# (KillWait=5) before the daemons go away.
cancel_jobs() {
    [[ -f $PIDS_DIR/slurmctld ]] && pid_alive "$PIDS_DIR/slurmctld" || return 0
    [[ -f $SLURM_CONF_PATH ]] || return 0
    local ids
    ids=$(timeout 10 squeue -h -o %i 2>/dev/null) || return 0
    [[ -n $ids ]] || return 0
    say "cancelling $(wc -w <<<"$ids") job(s)"
    # shellcheck disable=SC2086
    timeout 10 scancel $ids 2>/dev/null || true
    # A cancelled job leaves squeue once its processes are gone (<= KillWait + a bit).
    wait_until 15 bash -c '[[ -z $(timeout 5 squeue -h -o %i) ]]' || warn "jobs still listed after 15 s; stopping anyway"
}

# Each daemon takes 1.4-3 s to exit on SIGTERM: signal them all at once,
# then SIGKILL whatever is still there after a few seconds.
stop_daemons() {
    local f pids=() names=()
    for f in "$PIDS_DIR"/*; do
        [[ -e $f ]] || continue
        if pid_alive "$f"; then
            pids+=("$(cut -d' ' -f1 <"$f")")
            names+=("$(basename "$f")")
        fi
    done
    if ((${#pids[@]})); then
        say "stopping ${names[*]}"
        kill -TERM "${pids[@]}" 2>/dev/null || true
        kill_wait 8 "${pids[@]}"
    fi
    rm -f "$PIDS_DIR"/*
}

# kill_wait TIMEOUT PID...: wait for PIDs to exit, SIGKILL the stragglers.
kill_wait() {
    local timeout=$1; shift
    local end=$(($(date +%s) + timeout)) p alive
    while :; do
        alive=()
        for p in "$@"; do [[ -e /proc/$p ]] && alive+=("$p"); done
        ((${#alive[@]})) || return 0
        (($(date +%s) < end)) || break
        sleep 0.1
    done
    warn "SIGKILL to pid(s) ${alive[*]} (no exit after ${timeout}s)"
    kill -KILL "${alive[@]}" 2>/dev/null || true
    sleep 0.2
}

# Descendants of our daemons (slurmstepd, orphaned job tasks) that outlived them.
# up.sh tags every daemon with HPC_TOOLS_SLURM_DEV=$STATE (inherited by slurmstepd);
# job tasks carry SLURM_CLUSTER_NAME=$CLUSTER_NAME from slurmstepd.
stop_leftovers() {
    local f p pids=()
    # One grep over all environ files (-z: NUL-separated entries): cheap even on a busy box.
    # shellcheck disable=SC2013  # /proc/N/environ paths have no spaces
    for f in $(grep -lszxF -e "HPC_TOOLS_SLURM_DEV=$STATE" -e "SLURM_CLUSTER_NAME=$CLUSTER_NAME" /proc/[0-9]*/environ); do
        p=${f#/proc/}
        p=${p%/environ}
        ((p == $$ || p == PPID)) || pids+=("$p")
    done
    ((${#pids[@]})) || return 0
    say "stopping ${#pids[@]} leftover process(es) of the cluster: $(for p in "${pids[@]}"; do cat "/proc/$p/comm" 2>/dev/null; done | sort | uniq -c | tr -s ' \n' ' ')"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    kill_wait 5 "${pids[@]}"
}

remove_network() {
    local ns
    if [[ -f $OWNED_DIR/netns ]]; then
        while read -r ns; do
            if [[ -n $ns ]]; then ip netns del "$ns" 2>/dev/null || true; fi
        done <"$OWNED_DIR/netns"
        rm -f "$OWNED_DIR/netns"
    fi
    # Also any namespace with our prefix whose record got lost (state dir wiped by hand).
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$NS_PREFIX" || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
    if [[ -f $OWNED_DIR/bridge ]] || ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE" 2>/dev/null || true
        rm -f "$OWNED_DIR/bridge"
    fi
}

remove_files_outside_state() {
    hosts_remove_marked
    rm -f "$OWNED_DIR/hosts"
    if [[ -f $SLURM_CONF_PATH ]] && grep -q "$MARK" "$SLURM_CONF_PATH"; then
        rm -f "$SLURM_CONF_PATH"
    fi
    if [[ -f $SLURM_CONF_PATH.before-$MARK ]]; then
        mv -f "$SLURM_CONF_PATH.before-$MARK" "$SLURM_CONF_PATH"
    fi
    rm -f "$OWNED_DIR/slurm.conf"
    if [[ -f ${SLURM_CONF_PATH%/*}/topology.conf ]] && grep -q "$MARK" "${SLURM_CONF_PATH%/*}/topology.conf"; then
        rm -f "${SLURM_CONF_PATH%/*}/topology.conf"  # up.sh --switches
    fi
    if [[ -f $OWNED_DIR/cgroup-mount ]]; then
        umount /sys/fs/cgroup 2>/dev/null || warn "could not unmount /sys/fs/cgroup"
        rm -f "$OWNED_DIR/cgroup-mount"
    fi
}

main() {
    [[ $(id -u) -eq 0 ]] || { echo "down.sh: must run as root" >&2; exit 1; }
    local t0
    t0=$(now)
    if [[ ! -d $STATE ]]; then
        say "no state dir $STATE: nothing to stop"
        remove_network
        hosts_remove_marked
        return 0
    fi
    mkdir -p "$LOG_DIR"
    exec > >(tee -a "$LOG_DIR/down.log") 2>&1
    say "down.sh ($(date -Is)), state dir $STATE"
    local step t
    for step in cancel_jobs stop_daemons stop_leftovers remove_network remove_files_outside_state; do
        t=$(now)
        "$step" || warn "$step failed (ignored)"
        say "$(printf '%-34s %6ss' "$step" "$(elapsed "$t")")"
    done
    rm -f "$STATE/cluster.env"
    say "$(printf '%-34s %6ss' "down.sh total" "$(elapsed "$t0")")"
}

main "$@"
exit 0
