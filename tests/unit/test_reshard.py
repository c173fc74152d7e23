"""Which layout changes a Megatron checkpoint's optimizer state survives (hpc_tools.checkpoints.reshard): every single
change of a layout field, for both optimizer kinds, against the rule stated independently here; and the elastic
planner picks only layouts the rule lets a checkpoint resume into."""

from __future__ import annotations

import itertools

import pytest

from hpc_tools.checkpoints.reshard import DEFAULT_SIZES, optimizer_reshardable, why_not

BASE = {"tensor_size": 2, "pipeline_size": 2, "virtual_pipeline_size": None, "data_size": 2,
        "distributed_optimizer": True, "precision": "fp32", "context_size": 1, "expert_size": 1,
        "expert_tensor_size": 1, "first_stage_layers": None, "last_stage_layers": None}
CHANGES = {"tensor_size": [1, 4], "pipeline_size": [1, 4], "virtual_pipeline_size": [2], "data_size": [1, 4],
           "context_size": [2], "expert_size": [2, 4], "expert_tensor_size": [2], "first_stage_layers": [1],
           "last_stage_layers": [3], "precision": ["bf16"], "distributed_optimizer": [False]}


def expected(saved: dict, here: dict) -> bool:
    """The rule, stated on its own: same optimizer kind and precision; expert parallelism on in both or neither;
    with the distributed optimizer nothing but the data-parallel size may change."""
    if saved["distributed_optimizer"] != here["distributed_optimizer"] or saved["precision"] != here["precision"]:
        return False
    if (saved["expert_size"] > 1) != (here["expert_size"] > 1):
        return False
    if here["distributed_optimizer"]:
        return all(saved[k] == here[k] for k in saved if k not in ("data_size",))
    return True


CASES = [(dist, key, value) for dist in (True, False) for key, values in CHANGES.items() for value in values]


@pytest.mark.parametrize("dist, key, value", CASES, ids=[f"{'distopt' if d else 'plain'}-{k}={v}" for d, k, v in CASES])
def test_one_change(dist, key, value):
    saved = {**BASE, "distributed_optimizer": dist}
    here = {**saved, key: value}
    assert optimizer_reshardable(saved, here) == expected(saved, here), why_not(saved, here)
    reason = why_not(saved, here)
    assert (reason is None) == expected(saved, here)
    if reason is not None and key != "distributed_optimizer":  # the reason names what changed
        assert key.split("_")[0] in reason or key in reason, reason


def test_pairs_of_changes_match_the_rule():
    keys = [k for k in CHANGES if k != "distributed_optimizer"]
    for dist, (a, b) in itertools.product((True, False), itertools.combinations(keys, 2)):
        saved = {**BASE, "distributed_optimizer": dist}
        here = {**saved, a: CHANGES[a][0], b: CHANGES[b][0]}
        assert optimizer_reshardable(saved, here) == expected(saved, here), (dist, a, b, why_not(saved, here))


def test_a_meta_without_the_newer_sizes_was_saved_at_their_defaults():
    old = {k: v for k, v in BASE.items() if k not in DEFAULT_SIZES}
    assert optimizer_reshardable(old, {**BASE, "data_size": 4})
    assert not optimizer_reshardable(old, {**BASE, "expert_size": 2})


def test_the_elastic_planner_keeps_to_the_rule():
    """Every layout the elastic plan holds for a Megatron recipe resumes, optimizer included, from the recipe's."""
    from hpc_tools.checkpoints.reshard import layout_sizes
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.planner.elastic import plan_elastic
    from hpc_tools.recipe.load import load_recipe
    from tests.helpers import REPO

    sets = ["cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.min_nodes=1", "cluster.restarts=2",
            "training.global_batch_size=8"]
    for extra in ([], ["backend.megatron.distributed_optimizer=false"]):
        recipe = load_recipe(REPO / "recipes/gpt_3d.yaml", [*sets, *extra], profile="local")
        saved = layout_sizes(ParallelLayout.from_recipe(recipe), recipe.backend.megatron.distributed_optimizer,
                             recipe.training.precision)
        plan = plan_elastic(recipe)
        for k, overrides in plan.layouts.items():
            moved = load_recipe(REPO / "recipes/gpt_3d.yaml", [*sets, *extra, *overrides], profile="local")
            assert moved.cluster.nodes == k
            here = layout_sizes(ParallelLayout.from_recipe(moved), moved.backend.megatron.distributed_optimizer,
                                moved.training.precision)
            assert why_not(saved, here) is None, (k, plan.labels[k])
        if not extra:  # TP2 x PP2 cannot shrink to 2 ranks keeping its model-parallel sizes
            assert 1 not in plan.layouts and "keeps what the checkpoint cannot reshard" in plan.unplanned[1]
        else:
            assert 1 in plan.layouts


def _saved_checkpoint(root, layout: dict) -> None:
    """A complete iter_N folder with the meta a Megatron save writes (no shards: the check reads the meta only)."""
    import json

    from hpc_tools.checkpoints.dirs import META
    from hpc_tools.checkpoints.reshard import MEGATRON_FORMAT

    folder = root / "iter_0000010"
    folder.mkdir(parents=True)
    meta = {"format": MEGATRON_FORMAT, "model_only": False, "step": 10, "optimizer_steps": 10, "layout": layout,
            "files": {"world_size": 1, "by_rank": {"0": {}}}}
    (folder / META).write_text(json.dumps(meta))


@pytest.mark.parametrize("dist, key, value", [c for c in CASES if c[1] in ("tensor_size", "expert_size",
                                                                                "distributed_optimizer", "data_size")],
                         ids=lambda v: str(v))
def test_validate_refuses_a_load_path_whose_optimizer_state_the_layout_cannot_take(tmp_path, dist, key, value):
    """checkpoint.load_path saved under another layout: refused before a job is queued, in one line, exactly when
    the loader would refuse it (a Megatron MoE recipe, so every dimension is a real field)."""
    from hpc_tools.checkpoints.reshard import layout_sizes
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import load_recipe
    from hpc_tools.world import load_path_violations
    from tests.helpers import REPO

    sets = ["cluster.gpus_per_node=8", "cluster.nodes=1", "parallel.pipeline_size=1",
            "parallel.virtual_pipeline_size=null", f"backend.megatron.distributed_optimizer={str(dist).lower()}",
            "backend.megatron.overlap_param_gather=false", "training.global_batch_size=16", "training.precision=fp32",
            f"checkpoint.load_path={tmp_path}"]
    recipe = load_recipe(REPO / "recipes/gpt_moe.yaml", sets, profile="local")
    here = layout_sizes(ParallelLayout.from_recipe(recipe), dist, "fp32")
    saved = {**here, key: value}
    _saved_checkpoint(tmp_path, saved)
    found = load_path_violations(recipe)
    assert bool(found) == (why_not(saved, here) is not None), (saved, here, found)
    if found:
        [v] = found
        assert v.path == "checkpoint.load_path" and "iter_0000010" in v.rule and "\n" not in str(v)


@pytest.mark.parametrize("sets, words, distopt_hint", [
    (["backend.megatron.distributed_optimizer=true"], "keeps what the checkpoint cannot reshard", True),
    (["backend.megatron.distributed_optimizer=false", "cluster.gpu_type=H100-SXM", "cluster.gpu_mem_gb=0.001"],
     "no layout fits 1 node(s)", False),
])
def test_a_min_nodes_without_a_layout_is_refused_in_one_line(sets, words, distopt_hint):
    """validate/submit's elastic check: one violation naming the node count, why, and the fix (the distributed
    optimizer's hint only where it is the reason)."""
    from hpc_tools.planner.elastic import elastic_violations
    from hpc_tools.recipe.load import load_recipe
    from tests.helpers import REPO

    recipe = load_recipe(REPO / "recipes/gpt_3d.yaml", ["cluster.nodes=2", "cluster.gpus_per_node=2",
                                                        "cluster.min_nodes=1", "cluster.restarts=2", *sets],
                         profile="local")
    [v] = elastic_violations(recipe)
    assert v.path == "cluster.min_nodes" and v.value == 1 and words in v.rule and "\n" not in str(v)
    assert v.fix.startswith("set cluster.min_nodes: 2") and ("distributed_optimizer: false" in v.fix) == distopt_hint


def test_plan_prints_the_layouts_on_fewer_nodes():
    from tests.helpers import run_cli

    out = run_cli("plan", "recipes/gpt_3d.yaml", "--profile", "local", "--set", "cluster.nodes=3", "--set",
                  "cluster.gpus_per_node=2", "--set", "cluster.min_nodes=1", "--set", "cluster.restarts=2", "--set",
                  "backend.megatron.distributed_optimizer=false", "--set", "training.global_batch_size=12", "--set",
                  "parallel.pipeline_size=1", "--json")
    elastic = __import__("json").loads(out.stdout)["elastic"]
    assert set(elastic["layouts"]) | set(elastic["unplanned"]) == {"2", "1"}
    assert elastic["layouts"]["1"] and "cluster.nodes=1" in elastic["layouts"]["1"]


def test_every_new_run_of_an_elastic_recipe_holds_its_plan(tmp_path):
    """submit, sweeps and preflight all make their runs with submission.new_run: the run folder holds elastic.json
    (the restart controller and the ranks read it) for an elastic recipe, and none otherwise."""
    import json

    from hpc_tools.recipe.load import load_recipe
    from hpc_tools.submission import new_run
    from tests.helpers import REPO

    sets = ["cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.restarts=2"]
    elastic = new_run(load_recipe(REPO / "recipes/llama_fsdp.yaml", [*sets, "cluster.min_nodes=1"], profile="local"),
                      tmp_path)
    plan = json.loads((elastic.path / "elastic.json").read_text())
    assert plan["nodes"] == 2 and plan["min_nodes"] == 1 and "cluster.nodes=1" in plan["layouts"]["1"]
    plain = new_run(load_recipe(REPO / "recipes/llama_fsdp.yaml", sets, profile="local"), tmp_path)
    assert not (plain.path / "elastic.json").exists()
