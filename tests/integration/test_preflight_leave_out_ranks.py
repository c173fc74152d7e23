"""The rank program's side of leaving a named node out, on real ranks (gloo, torch) without a Slurm cluster: three
processes of ``python -m hpc_tools.runtime.rank`` (nodes are compared with their median from three on) given the
environment an srun rank step has (``SLURM_PROCID``, a node name each), with rank 1's GEMM made slow and the
controller's hints exported. With spares they all end the step with exit code 85 and rank 0 leaves the marker the
restart controller reads; without one they train on (auto). The controller's side is
tests/unit/test_preflight_leave_out.py; the real loop on Slurm is for the test cluster (docs/preflight.md)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from hpc_tools.recipe.load import dump_resolved, load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runtime.preflight import leave_out
from tests.helpers import REPO

NODES = 3


def run_folder(tmp_path) -> RunFolder:
    """comm_check's local profile on 3 nodes x 1 rank: preflight on (auto, multi-node), a light trainer."""
    recipe = load_recipe(REPO / "recipes" / "comm_check.yaml", profile="local",
                         overrides=[f"cluster.nodes={NODES}", "cluster.gpus_per_node=1"])
    return RunFolder.create(tmp_path, "r", dump_resolved(recipe), "", {"executor": "sbatch", "state": "STARTING",
                                                                        "world_size": NODES, "job_id": "77"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(run, hints: dict[str, str], timeout: float = 400) -> list[subprocess.CompletedProcess]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_TOOLS_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_RANK", "MASTER_"))}
    env.update(PYTHONPATH=str(REPO), SLURM_JOB_ID="77", SLURM_NTASKS=str(NODES), SLURM_JOB_NUM_NODES=str(NODES),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
               HPC_TOOLS_PREFLIGHT_SLOW_RANK="1", **hints)
    procs = [subprocess.Popen([sys.executable, "-m", "hpc_tools.runtime.rank", "--run-dir", str(run.path)],
                              env={**env, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r), "SLURM_LOCALID": "0",
                                   "SLURMD_NODENAME": f"node{r + 1}"}, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(NODES)]
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return out


# Spares for every node: on a loaded machine a healthy node can be named beside the slowed one (the test asserts that
# node2 is among the named, not that it is alone).
@pytest.mark.parametrize("hints, left", [({leave_out.SPARES_ENV: str(NODES)}, True),
                                         ({leave_out.SPARES_ENV: "0"}, False)])
def test_a_slow_node_ends_the_step_when_a_spare_exists_else_trains_on(tmp_path, hints, left):
    run = run_folder(tmp_path)
    done = ranks(run, hints)
    logs = "\n".join(p.stdout for p in done)
    saved = leave_out.read(run.path, 0)
    if left:
        assert [p.returncode for p in done] == [leave_out.EXIT_CODE] * NODES, logs[-4000:]
        assert saved is not None and "node2" in saved["nodes"], logs[-4000:]
        assert saved["details"]["node2"]["reasons"][0].startswith("GEMM "), saved
        assert re.search(r"leaving (\S+, )*node2(, \S+)* out of the run: a spare node takes its place", logs), \
            logs[-4000:]
        assert "Traceback" not in logs
        events = [e["event"] for e in run.manifest()["events"]]
        assert "preflight leave-out" in events and "completed" not in events
    else:
        assert [p.returncode for p in done] == [0] * NODES, logs[-4000:]
        assert saved is None
        assert "node node2 slow: GEMM" in logs, logs[-4000:]
        assert "training goes on (cluster.preflight=auto: nothing can replace " in logs, logs[-4000:]
