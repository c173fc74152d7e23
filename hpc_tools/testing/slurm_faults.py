"""Faults on the Slurm test cluster (environment/slurm-dev), for tests and benchmarks: a node's crash and its return.

In the multi-node test cluster every node ``nI`` is one network namespace (``hpcslurm-nI``) holding its slurmd and
every process slurmd started (its slurmstepd's, the job's tasks). A crash is every process of that namespace killed
with SIGKILL at once (``crash_node``); the return is a fresh slurmd started the way ``up.sh`` starts it
(``restart_slurmd``), after which slurmctld sees the node again (with ``ReturnToService=2`` it becomes usable).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

STATE = Path(os.environ.get("HPC_TOOLS_SLURM_STATE", "/var/tmp/hpc-tools-slurm"))
NS_PREFIX = "hpcslurm-"


def node_pids(node: str) -> list[int]:
    """Every process of test node ``node`` (its network namespace)."""
    out = subprocess.run(["ip", "netns", "pids", NS_PREFIX + node], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"node {node} is not a network-namespace node of the test cluster: {out.stderr.strip()}")
    return [int(p) for p in out.stdout.split()]


def crash_node(node: str) -> int:
    """SIGKILL every process of ``node`` (slurmd, slurmstepd, the tasks) at once, as a power loss would; returns how
    many were killed."""
    pids = node_pids(node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def restart_slurmd(node: str) -> int:
    """Start ``node``'s slurmd again as ``up.sh`` does (its namespace, its own hostname); returns its pid and records
    it where ``down.sh`` looks."""
    log = open(STATE / "log" / f"slurmd-{node}.stderr.log", "ab")
    cmd = ["setsid", "nsenter", f"--net=/run/netns/{NS_PREFIX}{node}", "unshare", "--uts", "--", "sh", "-c",
           'echo "$1" >/proc/sys/kernel/hostname && exec slurmd -D -N "$1"', "sh", node]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            env={**os.environ, "HPC_TOOLS_SLURM_DEV": str(STATE)})
    log.close()
    for _ in range(100):  # setsid/nsenter/unshare/sh exec: the pid becomes slurmd's
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "slurmd":
                break
        except OSError:
            break
        time.sleep(0.05)
    (STATE / "pids" / f"slurmd-{node}").write_text(f"{proc.pid} slurmd\n")
    return proc.pid


def node_state(node: str) -> str:
    out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip()


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (cpu.cfs_quota_us)


def slow_node(node: str, cpu_share: float = 0.2, root: Path = CPU_CGROUP, period_us: int = 100_000) -> Path:
    """Make ``node`` slow: every process of its namespace (its slurmd, and so everything slurmd starts later) moved
    into a cgroup v1 ``cpu`` group whose quota is ``cpu_share`` of one CPU (``cpu.cfs_quota_us`` over a
    ``period_us`` period, 100 ms by default). Work shorter than the quota (20 ms of a 100 ms period at 0.2) runs at
    full speed once per period: a short period (1 ms, the kernel's least) slows even a sub-millisecond GEMM, as a
    slow device would. Returns the group; ``unslow_node`` undoes it."""
    group = root / f"hpc_tools_slow_{node}"
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_quota_us").write_text("-1")  # unlimited first: the kernel refuses a quota over a shorter period
    (group / "cpu.cfs_period_us").write_text(str(period_us))
    (group / "cpu.cfs_quota_us").write_text(str(max(int(period_us * cpu_share), 1000)))
    for pid in node_pids(node):
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except OSError:  # a process that ended meanwhile
            pass
    return group


def unslow_node(node: str, root: Path = CPU_CGROUP) -> None:
    """Move ``node``'s processes back to the root cpu group and remove the slow group."""
    group = root / f"hpc_tools_slow_{node}"
    if not group.is_dir():
        return
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (root / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    group.rmdir()


def throttle_link(node: str, rate: str = "20mbit", device: str = "eth0") -> None:
    """Rate-limit ``node``'s link: a token-bucket filter (``tc qdisc ... tbf``) on its ``eth0`` inside its network
    namespace (every byte it sends). ``unthrottle_link`` removes it."""
    subprocess.run(["ip", "netns", "exec", NS_PREFIX + node, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                    "rate", rate, "burst", "32kbit", "latency", "400ms"], check=True, capture_output=True, timeout=10)


def unthrottle_link(node: str, device: str = "eth0") -> None:
    subprocess.run(["ip", "netns", "exec", NS_PREFIX + node, "tc", "qdisc", "del", "dev", device, "root"],
                   capture_output=True, timeout=10)
