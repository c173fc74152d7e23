"""A sweep on the Slurm test cluster (environment/slurm-dev/up.sh --nodes 2): 1 and 2 nodes, job arrays for cells
with equal resources, cell status from real sacct states (completed, and cancelled by scancel), then the analysis.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, run_cli

pytestmark = [pytest.mark.slurm, pytest.mark.multinode]
TERMINAL = {"completed", "failed", "out_of_memory", "timeout", "hang", "node_failure", "cancelled"}
LONG_ITERS = 10_000_000


def status(sweep: str) -> dict:
    out = run_cli("sweep", "status", sweep, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_until(sweep: str, done, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = status(sweep)
        if done(data):
            return data
        time.sleep(2)
    cells = [(c["id"], c["status"]) for c in data["cells"]]
    raise AssertionError(f"sweep {sweep} not done after {timeout_s} s: {cells}")


def test_sweep_over_one_and_two_nodes(slurm_multinode, tmp_path):
    raw = yaml.safe_load((REPO / "recipes/comm_check.yaml").read_text())
    raw["sweep"] = {"grid": {"cluster.nodes": [1, 2], "training.train_iters": [4, LONG_ITERS]}}
    recipe = tmp_path / "cc_nodes.yaml"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = run_cli("sweep", str(recipe), "--profile", "local", "--executor", "slurm", "--set", "cluster.gpus_per_node=1",
                  "--set", "training.log_interval=1000", "--runs-dir", str(tmp_path / "runs"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    sweep = data["sweep"]
    cells = {(c["params"]["cluster.nodes"], c["params"]["training.train_iters"]): c for c in data["cells"]}
    assert len(cells) == 4 and all(c["job_id"] for c in cells.values())
    # Equal resources (same node count, different iterations) -> one job array per node count.
    for nodes in (1, 2):
        short, long_ = cells[(nodes, 4)]["job_id"], cells[(nodes, LONG_ITERS)]["job_id"]
        assert "_" in short and short.split("_")[0] == long_.split("_")[0], (short, long_)
    assert cells[(1, 4)]["job_id"].split("_")[0] != cells[(2, 4)]["job_id"].split("_")[0]

    long_ids = {c["id"] for k, c in cells.items() if k[1] == LONG_ITERS}
    data = wait_until(sweep, lambda d: all(c["status"] == "completed" for c in d["cells"] if c["id"] not in long_ids)
                      and all(c["status"] == "running" for c in d["cells"] if c["id"] in long_ids))
    for cid in long_ids:
        job = next(c["job_id"] for c in data["cells"] if c["id"] == cid)
        subprocess.run(["scancel", job], check=True, timeout=30)
    data = wait_until(sweep, lambda d: all(c["status"] in TERMINAL for c in d["cells"]))
    assert {c["id"]: c["status"] for c in data["cells"]} == {
        c["id"]: ("cancelled" if c["id"] in long_ids else "completed") for c in cells.values()}

    # rerun --failed leaves cancelled cells alone; --status cancelled picks them.
    dry = run_cli("sweep", "rerun", sweep, "--failed", "--dry-run", "--json")
    assert dry.returncode == 0 and json.loads(dry.stdout)["rerun"] == [], dry.stderr
    dry = run_cli("sweep", "rerun", sweep, "--status", "cancelled", "--dry-run", "--json")
    assert sorted(json.loads(dry.stdout)["rerun"]) == sorted(long_ids)

    # The completed runs carry records from both nodes, and the analysis reads them as 1- and 2-rank runs.
    ana = run_cli("analyze", sweep, "--json")
    assert ana.returncode == 0, ana.stderr
    runs = {r["run_id"]: r for r in json.loads(ana.stdout)["runs"]}
    for nodes in (1, 2):
        row = runs[cells[(nodes, 4)]["run_id"]]
        assert row["world_size"] == nodes and row["nodes"] == nodes and row["ranks_reporting"] == nodes
        assert row["step_time_median_s"] > 0
    two = Path(sweep) / cells[(2, 4)]["run_dir"] / "records"
    hosts = {json.loads(line)["node"] for f in two.glob("rank*.jsonl") for line in f.read_text().splitlines()}
    assert len(hosts) == 2, hosts
