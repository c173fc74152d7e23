#!/usr/bin/env bash
# Smoke test of a cluster brought up by up.sh; prints the figures quoted in README.md.
#
#   bash environment/slurm-dev/selftest.sh            # everything that fits the current mode
#   bash environment/slurm-dev/selftest.sh --quick    # skip the ~60-90 s requeue test
#
# Single-node and multi-node checks are chosen from $STATE/cluster.env.
# torch / submitit checks are skipped (and say so) when those are not importable.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

QUICK=0
[[ ${1:-} == --quick ]] && QUICK=1
[[ -f $STATE/cluster.env ]] || { echo "selftest: no cluster (run up.sh first)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$STATE/cluster.env"
NODES=$HPC_TOOLS_SLURM_NODES
WORK=$(mktemp -d /tmp/slurm-dev-selftest.XXXXXX)
cd "$WORK"
FAILS=0

ok() { printf '  ok    %s\n' "$*"; }
bad() { printf '  FAIL  %s\n' "$*"; FAILS=$((FAILS + 1)); }
skip() { printf '  skip  %s\n' "$*"; }

job_state() { sacct -n -X -P -j "$1" -o State 2>/dev/null | head -1 | awk '{print $1}'; }

# wait_state ID STATE TIMEOUT: poll sacct every 50 ms.
wait_state() {
    local id=$1 want=$2 end=$(($(date +%s) + $3)) st
    while :; do
        st=$(job_state "$id")
        [[ $st == "$want" ]] && return 0
        (($(date +%s) < end)) || { echo "job $id: state '$st', wanted $want" >&2; return 1; }
        sleep 0.05
    done
}

t_hostname() {
    local id
    id=$(sbatch --parsable -o "$WORK/host-%j.out" --wrap hostname)
    if wait_state "$id" COMPLETED 30; then ok "sbatch --wrap hostname -> COMPLETED ($(cat "$WORK/host-$id.out"))"; else bad "hostname job $id"; fi
}

t_latency() {
    local n=10 id t0 sum=0 dt all=()
    for _ in $(seq 1 "$n"); do
        t0=$(now)
        id=$(sbatch --parsable -o /dev/null --wrap true)
        wait_state "$id" COMPLETED 30 || { bad "latency job $id"; return; }
        dt=$(elapsed "$t0")
        all+=("$dt")
        sum=$(awk -v a="$sum" -v b="$dt" 'BEGIN{print a+b}')
    done
    ok "sbatch -> COMPLETED (seen by sacct), mean over $n: $(awk -v s="$sum" -v n="$n" 'BEGIN{printf "%.2f", s/n}') s  [${all[*]}]"
}

t_test_only() {
    local out
    if out=$(sbatch --test-only --wrap true 2>&1) && grep -q "to start at" <<<"$out"; then ok "sbatch --test-only: $out"; else bad "sbatch --test-only: $out"; fi
}

t_cancel() {
    local id t0
    id=$(sbatch --parsable -o /dev/null --wrap 'sleep 300')
    wait_state "$id" RUNNING 30 || { bad "cancel: job never ran"; return; }
    t0=$(now)
    scancel "$id"
    if wait_state "$id" CANCELLED 30; then ok "scancel -> sacct CANCELLED in $(elapsed "$t0") s"; else bad "scancel job $id"; fi
}

t_requeue() {
    # Two jobs, --time=1 --requeue: the trap on USR2 (sent 30 s before the limit, may come
    # ~30 s early since Slurm checks limits every ~30 s) requeues the job; the second
    # run sees SLURM_RESTART_COUNT=1.
    #   batch: --signal=B:USR2@30, trap in the batch shell (without B: only steps get it)
    #   step:  --signal=USR2@30, trap in a task launched by srun (what submitit does)
    cat >"$WORK/requeue-body.sh" <<'EOF'
echo "start restart=${SLURM_RESTART_COUNT:-0} t=$(date +%s.%N) host=$(hostname)"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then echo "second run done"; exit 0; fi
sleep 200 &
trap 'echo "USR2 t=$(date +%s.%N)"; kill $!; scontrol requeue $SLURM_JOB_ID; exit 0' USR2
wait
EOF
    printf '#!/bin/bash\nsource %s\n' "$WORK/requeue-body.sh" >"$WORK/requeue-batch.sh"
    printf '#!/bin/bash\nsrun bash %s\n' "$WORK/requeue-body.sh" >"$WORK/requeue-step.sh"
    local t0 id_b id_s
    t0=$(now)
    local common=(--parsable --time=1 --requeue --open-mode=append -o "$WORK/requeue-%j.out")
    id_b=$(sbatch "${common[@]}" --signal=B:USR2@30 "$WORK/requeue-batch.sh")
    id_s=$(sbatch "${common[@]}" --signal=USR2@30 "$WORK/requeue-step.sh")
    requeue_report "batch shell, --signal=B:USR2@30" "$id_b" "$t0"
    requeue_report "srun step, --signal=USR2@30" "$id_s" "$t0"
}

requeue_report() {
    local what=$1 id=$2 t0=$3 out t_sig t_back
    local end=$(($(date +%s) + 150))
    until grep -q "second run done" "$WORK/requeue-$id.out" 2>/dev/null; do
        (($(date +%s) < end)) || { bad "requeue ($what): no second run in 150 s: $(tr '\n' '|' <"$WORK/requeue-$id.out" 2>/dev/null)"; return; }
        sleep 0.2
    done
    out=$(cat "$WORK/requeue-$id.out")
    t_sig=$(sed -n 's/^USR2 t=//p' <<<"$out" | head -1)
    t_back=$(sed -n 's/^start restart=1 t=\([0-9.]*\).*/\1/p' <<<"$out" | head -1)
    ok "requeue ($what): SLURM_RESTART_COUNT 0 -> 1; USR2 at +$(awk -v a="$t0" -v b="$t_sig" 'BEGIN{printf "%.1f", b-a}') s, running again $(awk -v a="$t_sig" -v b="$t_back" 'BEGIN{printf "%.1f", b-a}') s after the requeue"
}

t_multinode_srun() {
    local id out
    id=$(sbatch --parsable -N "$NODES" --ntasks-per-node=2 -o "$WORK/srun-%j.out" --wrap 'srun bash -c "echo \$SLURMD_NODENAME/\$(hostname)" | sort')
    if wait_state "$id" COMPLETED 60; then
        out=$(sort -u "$WORK/srun-$id.out" | tr '\n' ' ')
        ok "sbatch -N$NODES --ntasks-per-node=2 --wrap 'srun ...' -> $(wc -l <"$WORK/srun-$id.out") tasks, node/hostname: $out"
    else
        bad "multi-node srun job $id: $(cat "$WORK/srun-$id.out" 2>/dev/null)"
    fi
}

t_allreduce() {
    if ! python3 -c 'import torch' 2>/dev/null; then skip "gloo all_reduce: torch not importable"; return; fi
    local id t0
    t0=$(now)
    id=$(sbatch --parsable -N "$NODES" --ntasks-per-node=2 -o "$WORK/ar-%j.out" \
        --wrap "srun python3 $HERE/allreduce.py")
    if wait_state "$id" COMPLETED 180; then
        ok "gloo all_reduce over $NODES nodes x 2 ranks in $(elapsed "$t0") s: $(grep -m1 'sum' "$WORK/ar-$id.out")"
    else
        bad "all_reduce job $id: $(tail -5 "$WORK/ar-$id.out" 2>/dev/null)"
    fi
}

t_submitit() {
    if ! python3 -c 'import submitit' 2>/dev/null; then skip "submitit: not installed"; return; fi
    local t0 out
    t0=$(now)
    if out=$(python3 - "$WORK/submitit" <<'EOF' 2>&1
import sys, submitit
ex = submitit.AutoExecutor(folder=sys.argv[1], cluster="slurm")
ex.update_parameters(timeout_min=5, slurm_partition="debug", cpus_per_task=1)
def add(a, b):
    import socket
    return a + b, socket.gethostname()
job = ex.submit(add, 2, 3)
res = job.result()
assert res[0] == 5, res
print("result", res, "job", job.job_id)
EOF
    ); then ok "submitit AutoExecutor(cluster='slurm'): $(tail -1 <<<"$out") in $(elapsed "$t0") s"; else bad "submitit: $(tail -5 <<<"$out")"; fi
}

echo "selftest: $NODES node(s): $HPC_TOOLS_SLURM_NODE_NAMES (work dir $WORK)"
t_hostname
t_test_only
t_latency
t_cancel
if ((NODES > 1)); then
    t_multinode_srun
    t_allreduce
fi
t_submitit
if ((QUICK)); then skip "requeue (--quick)"; else t_requeue; fi
echo "selftest: $FAILS failure(s)"
if ((FAILS == 0)); then rm -rf "$WORK"; else echo "selftest: outputs kept in $WORK"; exit 1; fi
