#!/usr/bin/env bash
# Bring up a real Slurm cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) on
# this machine, as root, without systemd. See README.md next to this file.
#
#   bash environment/slurm-dev/up.sh                 # one slurmd on the host
#   bash environment/slurm-dev/up.sh --nodes 2       # 2 slurmd, one per network namespace
#   bash environment/slurm-dev/up.sh --nodes 4 --cpus-per-node 4 --mem-per-node 8000
#   bash environment/slurm-dev/up.sh --nodes 4 --switches 2   # topology/tree, leaves s1: n1 n3, s2: n2 n4
#
# A cluster that is already up (from an earlier up.sh) is stopped first, so
# running it again is how you switch modes. Why it does what it does (Slurm
# without systemd): docs/slurm-dev-cluster.md in the repository.
set -Eeuo pipefail
set +m # setsid must not fork, so that $! is the daemon's pid (see start_daemon)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

NODES=1
CPUS_PER_NODE=${HPC_TOOLS_SLURM_CPUS_PER_NODE:-4}
MEM_PER_NODE=${HPC_TOOLS_SLURM_MEM_PER_NODE:-8000}
SWITCHES=0  # --switches N: topology/tree with N leaf switches, node i on leaf ((i-1) mod N)+1 (interleaved)
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client iproute2 util-linux)
CURRENT_PHASE=startup

usage() {
    sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

parse_args() {
    while (($#)); do
        case $1 in
        --nodes) NODES=${2:?--nodes needs a number}; shift 2 ;;
        --nodes=*) NODES=${1#*=}; shift ;;
        --cpus-per-node) CPUS_PER_NODE=${2:?}; shift 2 ;;
        --cpus-per-node=*) CPUS_PER_NODE=${1#*=}; shift ;;
        --mem-per-node) MEM_PER_NODE=${2:?}; shift 2 ;;
        --mem-per-node=*) MEM_PER_NODE=${1#*=}; shift ;;
        --switches) SWITCHES=${2:?}; shift 2 ;;
        --switches=*) SWITCHES=${1#*=}; shift ;;
        -h | --help) usage 0 ;;
        *) echo "up.sh: unknown argument: $1" >&2; usage 2 >&2 ;;
        esac
    done
    [[ $NODES =~ ^[1-8]$ ]] || { echo "up.sh: --nodes must be 1..8 (got $NODES)" >&2; exit 2; }
    [[ $CPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || { echo "up.sh: bad --cpus-per-node" >&2; exit 2; }
    [[ $MEM_PER_NODE =~ ^[1-9][0-9]*$ ]] || { echo "up.sh: bad --mem-per-node" >&2; exit 2; }
    [[ $SWITCHES =~ ^[0-8]$ ]] || { echo "up.sh: --switches must be 0..8 (got $SWITCHES)" >&2; exit 2; }
}

# ---------------------------------------------------------------- failure
# die MESSAGE [LOG...]: one clear line, then the tail of the logs that matter.
die() {
    local msg=$1; shift
    trap - ERR
    {
        echo "up.sh: FAILED (phase: $CURRENT_PHASE): $msg"
        local f
        local shown=0
        if [[ -n $WAIT_LAST ]]; then
            echo "----- last output of the readiness probe"
            tail -n 10 <<<"$WAIT_LAST"
            shown=1
        fi
        for f in "$@"; do
            [[ -s $f ]] || continue
            echo "----- tail of $f"
            tail -n 25 "$f"
            shown=1
        done
        # Repeat the one-liner last, where CI logs are usually read from.
        ((shown)) && echo "up.sh: FAILED (phase: $CURRENT_PHASE): $msg"
        echo "up.sh: logs in $LOG_DIR; clean up with: bash $HERE/down.sh"
    } >&2
    exit 1
}

on_err() {
    local rc=$? line=$1 cmd=$2
    die "command failed (rc=$rc, line $line): $cmd" "$LOG_DIR"/*.log
}

phase() { # phase NAME: start timing a phase
    CURRENT_PHASE=$1
    PHASE_T0=$(now)
}
phase_done() { say "$(printf '%-34s %6ss' "$CURRENT_PHASE" "$(elapsed "$PHASE_T0")")"; }

# ---------------------------------------------------------------- packages
missing_commands() {
    local c
    for c in slurmctld slurmd slurmdbd sbatch sacct sacctmgr munged mariadb-install-db mariadb nsenter unshare setpriv ip setsid; do
        command -v "$c" >/dev/null 2>&1 || echo "$c"
    done
    command -v mariadbd >/dev/null 2>&1 || command -v mysqld >/dev/null 2>&1 || echo mariadbd
}

install_packages() {
    phase "install packages"
    local missing
    missing=$(missing_commands | tr '\n' ' ')
    if [[ -z ${missing// /} ]]; then
        phase_done
        return
    fi
    say "missing: $missing-> apt-get install ${PACKAGES[*]} (log: $LOG_DIR/apt.log)"
    # Package scripts try to start daemons (there is no init system to refuse); a
    # policy-rc.d that exits 101 forbids it. Only remove it afterwards if we are the ones who created it.
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\n# %s: no daemon starts during package install\nexit 101\n' "$MARK" >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0
    {
        export DEBIAN_FRONTEND=noninteractive
        local apt_opts=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confdef
            -o Dpkg::Options::=--force-confold -o DPkg::Lock::Timeout=300)
        # One retry: a mirror hiccup on a fresh CI machine should not fail the whole run.
        apt-get update -q && apt-get install "${apt_opts[@]}" "${PACKAGES[@]}" ||
            { sleep 5 && apt-get update -q && apt-get install "${apt_opts[@]}" "${PACKAGES[@]}"; }
    } >>"$LOG_DIR/apt.log" 2>&1 || rc=$?
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
    ((rc == 0)) || die "apt-get install failed (rc=$rc)" "$LOG_DIR/apt.log"
    missing=$(missing_commands | tr '\n' ' ')
    [[ -z ${missing// /} ]] || die "still missing after install: $missing" "$LOG_DIR/apt.log"
    phase_done
}

# ---------------------------------------------------------------- helpers
# start_daemon NAME LOG CMD...: run CMD in the foreground mode of the daemon, in
# its own session (a CI step's Ctrl-C/process-group kill must not reach it), and
# record "<pid> <comm>" so down.sh stops exactly what we started.
# HPC_TOOLS_SLURM_DEV tags the daemon and its descendants (slurmstepd) for down.sh.
start_daemon() {
    local name=$1 log=$2; shift 2
    HPC_TOOLS_SLURM_DEV=$STATE setsid "$@" </dev/null >>"$log" 2>&1 &
    local pid=$! comm=""
    # setsid/nsenter/unshare/sh all exec, so $! becomes the daemon itself; wait for that.
    local i
    for i in $(seq 1 50); do
        comm=$(cat "/proc/$pid/comm" 2>/dev/null) || die "$name exited right after start" "$log"
        case $comm in setsid | setpriv | env | nsenter | unshare | sh) sleep 0.02 ;; *) break ;; esac
    done
    echo "$pid $comm" >"$PIDS_DIR/$name"
}

# ---------------------------------------------------------------- state dir
prepare_state() {
    phase "prepare state dir"
    if compgen -G "$PIDS_DIR/*" >/dev/null || [[ -s $OWNED_DIR/netns || -s $OWNED_DIR/bridge ]]; then
        say "a cluster from an earlier up.sh is (partly) up: stopping it first"
        bash "$HERE/down.sh" || die "down.sh failed while stopping the previous cluster"
    fi
    # Fresh dynamic state every bring-up: job ids restart at 1 and no stale accounting
    # records (an old job with a reused id misleads submitit and sacct). Logs of the previous run are kept as *.prev.
    rm -rf "${STATE:?}/spool" "${STATE:?}/mysql" "${STATE:?}/etc" "${STATE:?}/run" "${PIDS_DIR:?}"
    mkdir -p "$STATE"/{spool/slurmctld,mysql,etc,run} "$PIDS_DIR" "$OWNED_DIR" "$LOG_DIR"
    local f
    for f in "$LOG_DIR"/*.log; do
        [[ -e $f && $f != "$LOG_DIR/up.log" && $f != "$LOG_DIR/apt.log" ]] && mv -f "$f" "$f.prev"
    done
    phase_done
}

# ---------------------------------------------------------------- cgroups
ensure_cgroup_fs() {
    CURRENT_PHASE="cgroup filesystem"
    # slurmd 22.05 still needs a cgroup filesystem at /sys/fs/cgroup, even
    # with proctrack/linuxproc + task/none. Containers usually have one; mount a
    # cgroup2 only when nothing is there (and let down.sh unmount it).
    if [[ -e /sys/fs/cgroup/cgroup.controllers ]] || compgen -G "/sys/fs/cgroup/*/tasks" >/dev/null ||
        compgen -G "/sys/fs/cgroup/*/cgroup.procs" >/dev/null; then
        return
    fi
    mkdir -p /sys/fs/cgroup
    mount -t cgroup2 none /sys/fs/cgroup || die "no cgroup filesystem at /sys/fs/cgroup and mounting cgroup2 failed"
    echo /sys/fs/cgroup >"$OWNED_DIR/cgroup-mount"
    say "mounted cgroup2 at /sys/fs/cgroup"
}

# ---------------------------------------------------------------- network
# Multi-node mode: one network namespace per slurmd, veth into a bridge carrying a
# private /24 with no default route, so nothing leaves the machine. The host end of the bridge ($SUBNET.1)
# is where slurmctld/slurmdbd are reached from the nodes.
# Fallback when namespaces cannot be made (or HPC_TOOLS_SLURM_NETNS=0): Debian's
# multiple-slurmd mode, every node on 127.0.0.1 with its own slurmd port.
setup_network() {
    phase "network ($NODES nodes)"
    local i
    if [[ ${HPC_TOOLS_SLURM_NETNS:-1} != 0 ]] && setup_netns; then
        NET_MODE=netns
        CTL_ADDR=$SUBNET.1
        for i in $(seq 1 "$NODES"); do NODE_ADDRS+=("$SUBNET.$((10 + i))"); done
    else
        [[ ${HPC_TOOLS_SLURM_NETNS:-1} == 0 ]] || warn "network namespaces failed (see $LOG_DIR/netns.log): falling back to multiple-slurmd mode on 127.0.0.1"
        bash "$HERE/down.sh" >/dev/null 2>&1 || true # drop a half-made bridge/namespaces
        NET_MODE=multiple-slurmd
        CTL_ADDR=127.0.0.1
        for i in $(seq 1 "$NODES"); do NODE_ADDRS+=(127.0.0.1); done
    fi
    say "node network: $NET_MODE"
    phase_done
}

# setup_netns: returns 1 (instead of exiting) on failure so that setup_network can fall back.
setup_netns() {
    if ip -o -4 addr show | grep -v " $BRIDGE " | grep -q " inet $SUBNET\."; then
        die "subnet $SUBNET.0/24 is already used on this machine; set HPC_TOOLS_SLURM_SUBNET=a.b.c"
    fi
    local log=$LOG_DIR/netns.log i node ns veth
    {
        ip link del "$BRIDGE" 2>/dev/null || true
        echo "$BRIDGE" >"$OWNED_DIR/bridge"
        ip link add "$BRIDGE" type bridge &&
            ip addr add "$SUBNET.1/24" dev "$BRIDGE" &&
            ip link set "$BRIDGE" up || return 1
        : >"$OWNED_DIR/netns"
        for i in $(seq 1 "$NODES"); do
            node=${NODE_NAMES[i - 1]}
            ns=$NS_PREFIX$node
            veth=hsv$i-$node
            veth=${veth:0:15}
            ip netns del "$ns" 2>/dev/null || true
            ip link del "$veth" 2>/dev/null || true
            echo "$ns" >>"$OWNED_DIR/netns"
            ip netns add "$ns" &&
                ip link add "$veth" type veth peer name eth0 netns "$ns" &&
                ip link set "$veth" master "$BRIDGE" up &&
                ip -n "$ns" link set lo up &&
                ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev eth0 &&
                ip -n "$ns" link set eth0 up || return 1
        done
        # The nodes must reach the controller's bridge address (br_netfilter/iptables could drop it).
        nsenter --net="/run/netns/$NS_PREFIX${NODE_NAMES[0]}" ip route get "$SUBNET.1" || return 1
    } >>"$log" 2>&1
}

# /etc/hosts: node names must resolve everywhere (slurmctld, srun, MASTER_ADDR in jobs).
setup_hosts() {
    CURRENT_PHASE="/etc/hosts"
    hosts_remove_marked
    local lines=() i
    if ((NODES > 1)); then
        for i in $(seq 1 "$NODES"); do
            lines+=("${NODE_ADDRS[i - 1]} ${NODE_NAMES[i - 1]}  # $MARK")
        done
    elif ! getent hosts "$HOST_SHORT" >/dev/null; then
        lines+=("127.0.1.1 $HOST_SHORT  # $MARK")
    fi
    ((${#lines[@]})) || return 0
    printf '%s\n' "${lines[@]}" >>/etc/hosts # append in place: /etc/hosts may be a bind mount
    echo /etc/hosts >"$OWNED_DIR/hosts"
}

# ---------------------------------------------------------------- configs
write_configs() {
    phase "write configs"
    local node_lines="" i
    if ((NODES == 1)); then
        node_lines="NodeName=$HOST_SHORT NodeAddr=127.0.0.1 CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE State=UNKNOWN"
    else
        local extra
        for i in $(seq 1 "$NODES"); do
            extra=""
            # multiple-slurmd: same host, one port per slurmd (slurmd -N picks its line).
            [[ $NET_MODE == netns ]] || extra=" NodeHostname=$HOST_SHORT Port=$((17000 + i))"
            node_lines+="NodeName=${NODE_NAMES[i - 1]} NodeAddr=${NODE_ADDRS[i - 1]}$extra CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE State=UNKNOWN"$'\n'
        done
    fi
    local topology_line=""
    if ((SWITCHES > 0)); then
        # Interleaved leaves (n1 n3 ... on s1, n2 n4 ... on s2): Slurm's node order is not the topology's, so
        # placement by topology has something to reorder. topology.conf sits beside the controller's slurm.conf.
        topology_line="TopologyPlugin=topology/tree"
        local s leaf_nodes all_leaves=""
        : >"$STATE/etc/topology.conf"
        for s in $(seq 1 "$SWITCHES"); do
            leaf_nodes=""
            for i in $(seq "$s" "$SWITCHES" "$NODES"); do leaf_nodes+="${leaf_nodes:+,}${NODE_NAMES[i - 1]}"; done
            [[ -n $leaf_nodes ]] && echo "SwitchName=s$s Nodes=$leaf_nodes" >>"$STATE/etc/topology.conf"
            all_leaves+="${all_leaves:+,}s$s"
        done
        echo "SwitchName=top Switches=$all_leaves" >>"$STATE/etc/topology.conf"
        sed -i "1i # $MARK: written by up.sh --switches $SWITCHES" "$STATE/etc/topology.conf"
    fi
    cat >"$STATE/etc/slurm.conf" <<EOF
# $MARK: written by hpc_tools environment/slurm-dev/up.sh ($(date -Is)); removed by down.sh.
# Mode: $NODES node(s), node network: $NET_MODE. State dir: $STATE
ClusterName=$CLUSTER_NAME
SlurmctldHost=$HOST_SHORT($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
# The default 120 s credential lifetime keeps a requeued job pending ~136 s; 5 is the minimum.
AuthInfo=cred_expire=5
# No MTA here (the default /bin/mail does not exist).
MailProg=/bin/true
StateSaveLocation=$STATE/spool/slurmctld
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroup-based tracking/affinity in this container (no delegated cgroup tree).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Advertise more CPUs than the machine has (ranks > cores) without the node being drained.
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
# Without slurmdbd, sacct exits 1 and submitit's job.result() can hang forever.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_ADDR
AccountingStoragePort=6819
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# Fast test turnaround: sbatch -> COMPLETED 0.64 s instead of 2.5 s.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1,sched_interval=1
# submitit ignores SIGTERM, so every cancel waits KillWait out (30 s by default).
KillWait=5
OverTimeLimit=0
# sbatch --wait polls after 2 s, then sleeps 4x longer each time while the sleep is under MinJobAge/2 (Slurm's
# src/sbatch/sbatch.c, _job_wait): with 30 it polled at 2, 10 and 42 s, so a job done in 15 s returned after 42 s.
# With 4 it polls every 2 s; a finished job leaves slurmctld after 4 s (sacct keeps it; Slurm's floor is 2).
MinJobAge=4
JobRequeue=1
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
$topology_line
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

    cat >"$STATE/etc/slurmdbd.conf" <<EOF
# $MARK: written by up.sh
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmdev
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$STATE/etc/slurmdbd.conf" # slurmdbd refuses a world-readable conf with a password

    # /etc/slurm/slurm.conf: the path every client (sbatch, sacct, submitit, srun in jobs)
    # looks at by default. Back up a foreign one; down.sh restores it.
    mkdir -p /etc/slurm
    if [[ -e $SLURM_CONF_PATH ]] && ! grep -q "$MARK" "$SLURM_CONF_PATH"; then
        cp -p "$SLURM_CONF_PATH" "$SLURM_CONF_PATH.before-$MARK"
        warn "backed up existing $SLURM_CONF_PATH to $SLURM_CONF_PATH.before-$MARK"
    fi
    echo "$SLURM_CONF_PATH" >"$OWNED_DIR/slurm.conf"
    cp "$STATE/etc/slurm.conf" "$SLURM_CONF_PATH"
    # slurmctld reads topology.conf from /etc/slurm (its compiled-in folder), not beside $SLURM_CONF
    local topology_conf="${SLURM_CONF_PATH%/*}/topology.conf"
    if [[ -f $STATE/etc/topology.conf ]]; then
        [[ -e $topology_conf ]] && ! grep -q "$MARK" "$topology_conf" && die "$topology_conf exists and is not ours"
        cp "$STATE/etc/topology.conf" "$topology_conf"
    elif [[ -f $topology_conf ]] && grep -q "$MARK" "$topology_conf"; then
        rm -f "$topology_conf"
    fi

    cat >"$STATE/cluster.env" <<EOF
# $MARK: the cluster up.sh brought up (sourceable)
HPC_TOOLS_SLURM_NODES=$NODES
HPC_TOOLS_SLURM_NODE_NAMES="${NODE_NAMES[*]}"
HPC_TOOLS_SLURM_NET_MODE=$NET_MODE
HPC_TOOLS_SLURM_CPUS_PER_NODE=$CPUS_PER_NODE
HPC_TOOLS_SLURM_MEM_PER_NODE=$MEM_PER_NODE
HPC_TOOLS_SLURM_PARTITION=debug
HPC_TOOLS_SLURM_CONF=$SLURM_CONF_PATH
EOF
    phase_done
}

# ---------------------------------------------------------------- daemons
# A Slurm/MariaDB not started from this state dir would make the daemons fail with
# obscure errors later: say it plainly now.
check_ports_free() {
    CURRENT_PHASE="check ports"
    local ports=(6817 6819 "$DB_PORT") i
    [[ $NET_MODE == netns ]] || ports+=(6818)
    if [[ $NET_MODE == multiple-slurmd ]]; then
        for i in $(seq 1 "$NODES"); do ports+=($((17000 + i))); done
    fi
    for i in "${ports[@]}"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$i") 2>/dev/null; then
            die "port $i is already in use by a process up.sh did not start (another Slurm/MariaDB?): ss -ltnp | grep :$i"
        fi
    done
}

start_munge() {
    phase "munged"
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        say "a munged is already answering: using it (not ours, down.sh leaves it)"
        phase_done
        return
    fi
    local key=/etc/munge/munge.key
    if [[ ! -s $key ]]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then mungekey --create --keyfile="$key" --force; else
            dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
        fi
    fi
    # munged insists on owner-only permissions for its key and dirs.
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge "$key" /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    chmod 0400 "$key"
    chmod 0755 /run/munge
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    # setpriv execs (runuser would stay as a parent), so the recorded pid is munged itself.
    start_daemon munged "$LOG_DIR/munged.stderr.log" setpriv --reuid=munge --regid=munge --init-groups munged -F
    wait_until 15 bash -c 'munge -n </dev/null | unmunge' || die "munged does not answer" "$LOG_DIR/munged.stderr.log" /var/log/munge/munged.log
    phase_done
}

start_mariadb() {
    phase "mariadb (fresh datadir)"
    local mariadbd
    mariadbd=$(command -v mariadbd || command -v mysqld)
    local sock=$STATE/run/mysqld.sock
    mariadb-install-db --no-defaults --user=root --datadir="$STATE/mysql" --auth-root-authentication-method=socket \
        --skip-test-db >"$LOG_DIR/mariadb-install-db.log" 2>&1 ||
        die "mariadb-install-db failed" "$LOG_DIR/mariadb-install-db.log"
    start_daemon mariadbd "$LOG_DIR/mariadbd.log" "$mariadbd" --no-defaults --user=root \
        --datadir="$STATE/mysql" --socket="$sock" --pid-file="$STATE/run/mariadbd.pid" \
        --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve --skip-log-bin \
        --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 --log-error="$LOG_DIR/mariadbd.log"
    wait_until 60 mariadb-admin --no-defaults --socket="$sock" -uroot ping || die "mariadbd does not answer" "$LOG_DIR/mariadbd.log"
    mariadb --no-defaults --socket="$sock" -uroot <<'EOF' || die "creating the slurm DB user failed" "$LOG_DIR/mariadbd.log"
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmdev';
CREATE USER 'slurm'@'localhost' IDENTIFIED BY 'slurmdev';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
    phase_done
}

start_slurmdbd() {
    phase "slurmdbd + cluster registration"
    # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF: point it at the state dir
    # so the DB password never lands in /etc.
    start_daemon slurmdbd "$LOG_DIR/slurmdbd.stderr.log" env SLURM_CONF="$STATE/etc/slurm.conf" slurmdbd -D
    wait_until 60 sacctmgr -n -P list cluster || die "slurmdbd does not answer" "$LOG_DIR/slurmdbd.log" "$LOG_DIR/slurmdbd.stderr.log"
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
        sacctmgr -i add cluster "$CLUSTER_NAME" >>"$LOG_DIR/sacctmgr.log" 2>&1 ||
            die "sacctmgr add cluster failed" "$LOG_DIR/sacctmgr.log" "$LOG_DIR/slurmdbd.log"
    fi
    phase_done
}

start_slurmctld() {
    phase "slurmctld"
    start_daemon slurmctld "$LOG_DIR/slurmctld.stderr.log" slurmctld -D -i
    wait_until 30 bash -c 'scontrol ping | grep -q "is UP"' ||
        die "slurmctld is not UP" "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmctld.stderr.log"
    phase_done
}

start_slurmds() {
    phase "slurmd x$NODES"
    local node
    for node in "${NODE_NAMES[@]}"; do
        mkdir -p "$STATE/spool/slurmd-$node"
        if [[ $NET_MODE != netns ]]; then
            start_daemon "slurmd-$node" "$LOG_DIR/slurmd-$node.stderr.log" slurmd -D -N "$node"
        else
            # `ip netns exec` remounts /sys and slurmd then fails on cgroups; nsenter
            # only switches the network namespace. unshare --uts gives the node its own hostname
            # (so `hostname` in a job prints the node name).
            start_daemon "slurmd-$node" "$LOG_DIR/slurmd-$node.stderr.log" \
                nsenter --net="/run/netns/$NS_PREFIX$node" unshare --uts -- \
                sh -c 'echo "$1" >/proc/sys/kernel/hostname && exec slurmd -D -N "$1"' sh "$node"
        fi
    done
    local logs=()
    for node in "${NODE_NAMES[@]}"; do logs+=("$LOG_DIR/slurmd-$node.log" "$LOG_DIR/slurmd-$node.stderr.log"); done
    wait_until 60 all_nodes_idle || {
        sinfo -N -l >&2 || true
        die "not all $NODES node(s) idle" "${logs[@]}" "$LOG_DIR/slurmctld.log"
    }
    phase_done
}

all_nodes_idle() {
    local out
    out=$(sinfo -h -N -o '%N %T') || return 1
    [[ $(grep -c ' idle$' <<<"$out") -eq $NODES ]]
}

check_accounting() {
    phase "sacct answers"
    wait_until 30 sacct -n -X || die "sacct does not answer" "$LOG_DIR/slurmdbd.log" "$LOG_DIR/slurmctld.log"
    phase_done
}

# ---------------------------------------------------------------- main
main() {
    parse_args "$@"
    [[ $(id -u) -eq 0 ]] || { echo "up.sh: must run as root" >&2; exit 1; }
    mkdir -p "$LOG_DIR"
    exec > >(tee -a "$LOG_DIR/up.log") 2>&1
    trap 'on_err $LINENO "$BASH_COMMAND"' ERR
    local t0
    t0=$(now)
    say "up.sh $* ($(date -Is)), state dir $STATE"

    HOST_SHORT=$(hostname -s 2>/dev/null || cat /proc/sys/kernel/hostname)
    HOST_SHORT=${HOST_SHORT%%.*}
    # Single node: the host itself. Several: n1..nN (set up by setup_network).
    NET_MODE=host
    CTL_ADDR=127.0.0.1
    NODE_NAMES=()
    NODE_ADDRS=()
    if ((NODES == 1)); then
        NODE_NAMES=("$HOST_SHORT")
        NODE_ADDRS=(127.0.0.1)
    else
        local i
        for i in $(seq 1 "$NODES"); do NODE_NAMES+=("$NODE_PREFIX$i"); done
    fi

    install_packages
    prepare_state
    ensure_cgroup_fs
    if ((NODES > 1)); then setup_network; fi
    setup_hosts
    check_ports_free
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmds
    check_accounting

    CURRENT_PHASE=total
    say "$(printf '%-34s %6ss' "up.sh total" "$(elapsed "$t0")")"
    say "cluster '$CLUSTER_NAME' UP: partition 'debug', nodes ${NODE_NAMES[*]}, $CPUS_PER_NODE CPUs and ${MEM_PER_NODE} MB each; node network: $NET_MODE; conf $SLURM_CONF_PATH"
    sinfo
}

main "$@"
