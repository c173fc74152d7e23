"""The rank side of elastic training (hpc_tools.runtime.elastic): the recipe a step on fewer nodes trains in, and the
manifest's layouts; and the submitit task's exit code (a rank's non-zero return must reach srun)."""

from __future__ import annotations

import pytest

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import dump_resolved, load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runtime import elastic
from tests.helpers import REPO

SETS = ["cluster.nodes=3", "cluster.gpus_per_node=2", "cluster.restarts=2", "cluster.min_nodes=1",
        "training.global_batch_size=12"]


def run_with_plan(tmp_path, sets=SETS) -> tuple[RunFolder, object]:
    from hpc_tools.planner.elastic import plan_elastic, write

    recipe = load_recipe(REPO / "recipes/llama_fsdp.yaml", sets, profile="local")
    run = RunFolder.create(tmp_path, "r", dump_resolved(recipe), "", {"state": "RUNNING"})
    write(run.path, plan_elastic(recipe))
    return run, recipe


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_step_on_fewer_nodes_trains_in_the_planned_layout(tmp_path, nodes):
    run, recipe = run_with_plan(tmp_path)
    fewer = elastic.for_world(run, recipe, nodes * 2)
    assert fewer is not None and fewer.cluster.nodes == nodes
    lay = ParallelLayout.from_recipe(fewer)
    assert lay.world_size == nodes * 2 and lay.global_batch_size == 12  # the global batch is the recipe's
    assert fewer.model == recipe.model and fewer.data == recipe.data  # the model and the data order too


@pytest.mark.parametrize("world", [3, 5, 8, 12])
def test_a_world_without_a_planned_layout_gets_none(tmp_path, world):
    run, recipe = run_with_plan(tmp_path)
    assert elastic.for_world(run, recipe, world) is None  # not a whole number of nodes, or more than the recipe's


def test_a_recipe_that_is_not_elastic_never_changes_its_layout(tmp_path):
    run, recipe = run_with_plan(tmp_path, [s for s in SETS if not s.startswith("cluster.min_nodes")])
    assert elastic.for_world(run, recipe, 2) is None


def test_the_manifest_records_each_layout_once_with_its_cause(tmp_path):
    run, recipe = run_with_plan(tmp_path)
    full = ParallelLayout.from_recipe(recipe)
    one = elastic.for_world(run, recipe, 2)
    elastic.note(run, recipe, full, 0, 3)
    elastic.note(run, recipe, full, 5, 3)  # a restart in the same layout: nothing new
    elastic.note(run, one, ParallelLayout.from_recipe(one), 10, 3)
    elastic.note(run, recipe, full, 20, 3)
    got = [(e["from_iteration"], e["nodes"], e["cause"]) for e in run.manifest()["layouts"]]
    assert got == [(0, 3, "recipe"), (10, 1, "fewer nodes"), (20, 3, "regrown")]


def test_a_first_start_on_fewer_nodes_is_recorded_as_such(tmp_path):
    """Preflight left a node out before any step: the first layout recorded is already the smaller one."""
    run, recipe = run_with_plan(tmp_path)
    two = elastic.for_world(run, recipe, 4)
    elastic.note(run, two, ParallelLayout.from_recipe(two), 0, 3)
    assert [(e["nodes"], e["cause"]) for e in run.manifest()["layouts"]] == [(2, "fewer nodes")]


@pytest.mark.parametrize("code", [0, 85, 1])
def test_the_submitit_task_exits_with_the_ranks_code(monkeypatch, code):
    """A rank that returns non-zero (preflight leaving its node out) ends its submitit task with that code, so srun
    fails and the teardown's restart loop runs (submitit records a returned value as a success)."""
    from hpc_tools.executors import slurm
    from hpc_tools.runtime import rank

    monkeypatch.setattr(rank, "run_rank", lambda run_dir: code)
    if code:
        with pytest.raises(SystemExit) as exc:
            slurm.rank_task("run")
        assert exc.value.code == code
    else:
        assert slurm.rank_task("run") == 0
