"""``hpc_tools preflight --executor slurm`` on the 2-node test cluster: the checks run as a Slurm job of their own on
the recipe's nodes (each node in its own network namespace, so gloo crosses a real veth link), the table has a row
per Slurm node with the interface gloo used, and two healthy nodes are certified within the 60 s budget."""

from __future__ import annotations

import json

import pytest

from hpc_tools.registry import list_runs
from tests.helpers import run_cli

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.slow]


def test_preflight_as_a_slurm_job_certifies_both_nodes(slurm_multinode, tmp_path):
    out = run_cli("preflight", "recipes/comm_check.yaml", "--executor", "slurm", "--profile", "local",
                  "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=1", "--runs-dir", str(tmp_path),
                  "--json", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(out.stdout)
    rows = {r["node"]: r for r in data["nodes"]}
    assert sorted(rows) == ["n1", "n2"], data
    assert all(r["verdict"] == "ok" for r in rows.values()), data
    transports = {r["transport"] for r in rows.values()}
    assert all(t.startswith("gloo:") and not t.startswith("gloo:lo ") for t in transports), transports
    assert 0 < data["seconds"] <= data["budget_s"] == 60, data
    (run,) = list_runs(tmp_path)
    manifest = run.manifest()
    assert manifest["executor"] == "slurm" and manifest["job_id"] and manifest["kind"] == "preflight"
    assert (run.path / "preflight.json").is_file()
