"""Preflight against faults on the Slurm test cluster brought up with 3 nodes (``bash environment/slurm-dev/up.sh
--nodes 3``): for each case, ``hpc_tools preflight --executor slurm`` over all three nodes (comm_check's local
profile, one rank per node), and what it printed: the per-node table, the verdict line, its own time.

- healthy: nothing done;
- slow node: every process of n3 in a cgroup v1 ``cpu`` group with a fifth of a CPU (``cpu.cfs_quota_us``);
- throttled link: a ``tc ... tbf`` rate limit (20 mbit) on n3's ``eth0`` inside its network namespace;
- wrong interface: n3's rank given ``GLOO_SOCKET_IFNAME=nope0`` (a name no node has).

    PYTHONPATH=. python benchmarks/preflight_faults.py [--node n3] [--cases healthy,slow,link,interface]

Each fault is undone after its case (also when the case fails).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from hpc_tools.runtime.preflight.measure import IFNAME_RANK_ENV
from hpc_tools.testing import slurm_faults

CASES = ("healthy", "slow", "link", "interface")


def preflight(runs: str, env: dict[str, str] | None = None) -> tuple[int, dict | None, str, float]:
    import os

    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hpc_tools", "preflight", "recipes/comm_check.yaml", "--executor",
                          "slurm", "--profile", "local", "--set", "cluster.nodes=3", "--set",
                          "cluster.gpus_per_node=1", "--runs-dir", runs, "--json"], capture_output=True, text=True,
                         timeout=900, env={**os.environ, **(env or {})})
    wall = time.monotonic() - t0
    try:
        data = json.loads(out.stdout)
    except json.JSONDecodeError:
        data = None
    return out.returncode, data, out.stderr, wall


def show(case: str, code: int, data: dict | None, err: str, wall: float) -> None:
    print(f"\n== {case}: exit {code}, command wall {wall:.1f} s")
    if not data:
        print(err[-2000:])
        return
    if "nodes" not in data:
        print(data.get("error"))
        return
    for row in data["nodes"]:
        print(f"  {row['node']:4s} GEMM {row.get('gemm_tflops') or 0:.3g} TFLOP/s  busbw "
              f"{row.get('busbw_gbps') or 0:.3g} GB/s  {row.get('transport')}  {row['verdict']}  "
              f"{'; '.join(row.get('reasons') or [])}")
    print(f"  preflight's own time {data['seconds']:.1f} s (budget {data['budget_s']:g} s); named: {data['named']}; "
          f"problems: {data.get('problems')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", default="n3")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    node = args.node
    rank = int(node.lstrip("n")) - 1  # one rank per node, in node order
    with tempfile.TemporaryDirectory() as runs:
        for case in args.cases.split(","):
            env = {}
            try:
                if case == "slow":
                    slurm_faults.slow_node(node, 0.2)
                elif case == "link":
                    slurm_faults.throttle_link(node, "20mbit")
                elif case == "interface":
                    env = {IFNAME_RANK_ENV: f"{rank}:nope0"}
                show(case, *preflight(runs, env))
            finally:
                slurm_faults.unslow_node(node)
                slurm_faults.unthrottle_link(node)


if __name__ == "__main__":
    main()
