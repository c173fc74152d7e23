"""Preflight against faults on the Slurm test cluster brought up with 3 nodes (``bash environment/slurm-dev/up.sh
--nodes 3``): for each case, ``hpc_tools preflight --executor slurm`` over all three nodes (comm_check's local
profile, one rank per node), and what it printed: the per-node table, the verdict line, its own time.

- healthy: nothing done;
- slow node: every process of n3 in a cgroup v1 ``cpu`` group with a fifth of a CPU (``cpu.cfs_quota_us``);
- throttled link: a ``tc ... tbf`` rate limit (20 mbit) on n3's ``eth0`` inside its network namespace;
- wrong interface: n3's rank given ``GLOO_SOCKET_IFNAME=nope0`` (a name no node has);
- spare: a training job (comm_check, 2 nodes and ``cluster.spare_nodes=1``, ``restarts=1``, preflight ``auto``)
  with its second node slowed as above: preflight names it, the step ends, the next step trains on the first node
  and the spare; printed: the job's state, the nodes each start ran on, the leave-out event;
- fewer: a training job without a spare (recipes/llama_fsdp.yaml's local profile, all 3 nodes, one rank each,
  ``cluster.min_nodes=2``, ``restarts=1``) with n3 slowed as above: preflight names it, the step ends, and the next
  step trains on n1 and n2 in the layout the planner chose for two nodes (submitted through submitit); printed as
  for the spare case, with the manifest's layouts.

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

CASES = ("healthy", "slow", "link", "interface", "spare", "fewer")
LEAVE_OUT_JOBS = {  # case -> (the node slowed, its cfs period in us, the submit arguments)
    "spare": ("n2", 100_000, ["recipes/comm_check.yaml", "--set", "cluster.nodes=2", "--set", "cluster.spare_nodes=1",
                     "--set", "training.train_iters=20"]),
    "fewer": ("n3", 100_000, ["recipes/llama_fsdp.yaml", "--set", "cluster.nodes=3", "--set", "cluster.min_nodes=2",
                     "--set", "training.train_iters=12", "--set", "checkpoint.interval_iters=4",
                     "--set", "training.global_batch_size=12",
                     # bf16: the preflight GEMM then takes ~25 ms on a CPU, longer than the slowed node's 20 ms of
                     # CPU per 100 ms, so its quota shows in the GEMM figure (an fp32 one ends within the quota)
                     "--set", "training.precision=bf16",
                     "--set", "cluster.preflight=auto"]),
}


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


def leave_out_job(runs: str, case: str) -> None:
    """The spare and fewer cases: slow a node of the job, submit, wait, print how the run went."""
    import os

    node, period_us, args = LEAVE_OUT_JOBS[case]
    slurm_faults.slow_node(node, 0.2, period_us=period_us)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hpc_tools", "submit", *args[:1], "--profile", "local",
                          "--executor", "slurm", "--wait", "--json", "--runs-dir", runs, *args[1:],
                          "--set", "cluster.gpus_per_node=1", "--set", "cluster.restarts=1"], capture_output=True,
                         text=True, timeout=900, env=dict(os.environ))
    wall = time.monotonic() - t0
    print(f"\n== {case}: exit {out.returncode}, submit to end {wall:.1f} s")
    try:
        run_dir = json.loads(out.stdout)["run_dir"]
    except (json.JSONDecodeError, KeyError):
        print(out.stdout[-1500:], out.stderr[-1500:])
        return
    from pathlib import Path

    from hpc_tools.registry import RunFolder

    m = RunFolder(run_dir).manifest()
    print(f"  state {m.get('state')}; events: {[e.get('event') for e in m.get('events', [])]}")
    for e in m.get("restarts") or []:
        print(f"  restart {e.get('restart')}: cause {e.get('cause')}, nodes {e.get('nodes') or e.get('nodelist')}, "
              f"decision {e.get('decision')}: {e.get('why')}")
    for e in m.get("layouts") or []:
        print(f"  layout from step {e.get('from_iteration')}: {e.get('layout')} ({e.get('cause')})")
    events = [json.loads(line) for p in sorted(Path(run_dir, "records").glob("events_rank*.jsonl"))
              for line in p.read_text().splitlines() if line.strip()]
    starts = sorted({(e.get("restart"), e.get("node")) for e in events if e.get("event") == "start"})
    print(f"  (start, node) of every rank that reached step 1: {starts}")
    marker = Path(run_dir, "preflight-leave-out.json")
    for path in Path(run_dir).glob("preflight-leave-out*.json"):
        print(f"  {path.name}: {json.loads(path.read_text()).get('line')}")
    if not marker.exists():
        print("  (no preflight-leave-out.json at the run folder's top)")


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
                if case in LEAVE_OUT_JOBS:
                    leave_out_job(runs, case)
                    continue
                show(case, *preflight(runs, env))
            finally:
                for n in {node, "n2", "n3"}:
                    slurm_faults.unslow_node(n)
                slurm_faults.unthrottle_link(node)


if __name__ == "__main__":
    main()
