"""The training recipes across two nodes of the namespace test cluster, through the rendered sbatch script, and on
the local default through the real CLI (the README's main command)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder, list_runs
from tests.helpers import REPO, loss_curve, run_cli, step_records

pytestmark = pytest.mark.slow


def nodes_of(run: RunFolder) -> dict[int, str]:
    return {rank: recs[0]["node"] for rank, recs in step_records(run.path).items()}


CASES = {
    # TP2 x PP2 across 2 nodes x 2 ranks: tensor-parallel pairs inside a node, the pipeline between the nodes.
    "megatron-tp2pp2": ("recipes/gpt_3d.yaml", ["cluster.nodes=2", "cluster.gpus_per_node=2"], 4),
    # ZeRO-2 data parallel with one rank on each node.
    "deepspeed-zero2": ("recipes/gpt_zero.yaml", ["cluster.nodes=2", "cluster.gpus_per_node=1"], 2),
}


@pytest.mark.slurm
@pytest.mark.multinode
@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_trains_across_two_nodes_through_the_rendered_script(slurm_multinode, tmp_path, case):
    recipe, sets, ranks = CASES[case]
    script = tmp_path / "job.sbatch"
    overrides = [x for s in sets + ["training.train_iters=8", "checkpoint.interval_iters=0"] for x in ("--set", s)]
    out = run_cli("render", recipe, "--profile", "local", *overrides, "-o", str(script))
    assert out.returncode == 0, out.stderr
    job = subprocess.run(["sbatch", "--parsable", "--wait", str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs")})
    job_id = job.stdout.strip().split(";")[0]
    (run,) = list_runs(tmp_path / "runs")
    batch_log = run.manifest().get("batch_log")
    log = Path(batch_log).read_text()[-3000:] if batch_log and Path(batch_log).is_file() else ""
    assert job.returncode == 0, f"job {job_id}: {job.stderr}\n{log}"
    assert run.manifest()["state"] == "COMPLETED"
    placement = nodes_of(run)
    assert sorted(placement) == list(range(ranks)) and len(set(placement.values())) == 2, placement
    curve = loss_curve(run.path)
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1], curve


@pytest.mark.parametrize("recipe", ["recipes/gpt_3d.yaml", "recipes/gpt_zero.yaml"])
def test_submit_on_the_local_default_trains_with_a_falling_loss(main_command, recipe):
    # The README's main command, shared with the tests that read the same run (tests/conftest.py main_command).
    out = main_command(recipe)
    assert out["returncode"] == 0, out["stderr"][-3000:]
    result = out["result"]
    run = RunFolder(result["run_dir"])
    assert result["state"] == "COMPLETED" and run.manifest()["profile"] == "local"
    iters = load_recipe(REPO / recipe, profile="local").training.train_iters
    curve = loss_curve(run.path)
    assert sorted(curve) == list(range(1, iters + 1)) and curve[iters] < curve[1], curve
