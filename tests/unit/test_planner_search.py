"""The configuration search: what it keeps, how it ranks, and what submit --auto gets from it."""

from __future__ import annotations

import pytest

from hpc_tools.errors import UserError
from hpc_tools.planner import auto_configure, fit_violations, plan_recipe, search
from hpc_tools.planner.knobs import Knobs, apply_knobs
from hpc_tools.planner.search import why_slower
from hpc_tools.recipe.load import load_recipe
from hpc_tools.recipe.rules import check_recipe
from tests.helpers import REPO
from tests.unit.inline_recipes import inline_recipe

BIG = ["model.num_layers=48", "model.hidden_size=8192", "model.num_attention_heads=64",
       "parallel.virtual_pipeline_size=null", "cluster.nodes=4"]


def recipe(name: str, *overrides: str):
    """The test's own copy of a production recipe (tests/unit/inline_recipes.py), rules not yet checked."""
    return inline_recipe(name.removesuffix(".yaml"), *overrides, check=False)


@pytest.fixture(scope="module")
def big_result():
    return search(recipe("gpt_3d.yaml", *BIG), top=5, losers=5, use_calibration=False)


def test_ranked_fit_keep_rules_and_are_sorted(big_result):
    r = recipe("gpt_3d.yaml", *BIG)
    res = big_result
    assert len(res.ranked) == 10 and res.too_big > 0 and res.enumerated == res.too_big + res.fitting
    times = [c.step_s for c in res.ranked]
    assert times == sorted(times)
    assert res.headroom_bytes == pytest.approx(0.05 * res.mem_bytes + 1e9)  # the default margin
    for c in res.ranked:
        assert c.memory_bytes <= res.usable_bytes == res.mem_bytes - res.headroom_bytes
        applied = apply_knobs(r, c.knobs)
        assert check_recipe(applied) == [] and fit_violations(applied) == []
        assert c.knobs.layout.global_batch_size == r.training.global_batch_size  # tokens per step are held fixed


def test_scores_equal_the_plan_of_the_applied_recipe(big_result):
    r = recipe("gpt_3d.yaml", *BIG)
    best = big_result.best
    via_overrides = inline_recipe("gpt_3d", *BIG, *best.knobs.overrides())
    plan = plan_recipe(via_overrides, use_calibration=False)
    assert plan.time.total_s == pytest.approx(best.step_s)
    assert plan.memory.total == pytest.approx(best.memory_bytes)
    assert Knobs.from_recipe(via_overrides).describe() == best.knobs.describe()
    # the recipe as written does not fit; the search fixes it
    assert plan_recipe(r, use_calibration=False).fits is False


def test_losers_are_explained(big_result):
    best = big_result.best
    for c in big_result.ranked[1:]:
        reason = why_slower(c, best)
        assert "slower" in reason or "same step time" in reason


def test_rule_breakers_are_pruned():
    # overlap_param_gather needs the distributed optimizer: every candidate without it must be dropped by the rules
    res = search(recipe("gpt_3d.yaml"), top=3, losers=20, use_calibration=False)
    assert all(c.knobs.sharding.distributed_optimizer for c in res.ranked)
    assert res.broke_rules and all(not c.knobs.sharding.distributed_optimizer for c, _ in res.broke_rules)
    assert all(v.path == "backend.megatron.overlap_param_gather" for _, v in res.broke_rules)


def test_deepspeed_search_respects_pipeline_and_stages():
    res = search(recipe("gpt_zero.yaml"), top=5, losers=30, use_calibration=False)
    assert res.ranked
    for c in res.ranked:
        lay = c.knobs.layout
        assert lay.tensor_size == 1 and not lay.sequence_parallel and c.knobs.recompute != "selective"
        assert lay.pipeline_size == 1 or c.knobs.sharding.zero_stage <= 1


def test_auto_configure_returns_a_valid_recipe():
    r = recipe("gpt_3d.yaml", *BIG)
    chosen, overrides, best = auto_configure(r, efficiency=0.5)
    assert check_recipe(chosen) == [] and fit_violations(chosen) == []
    assert chosen.model == r.model and chosen.cluster == r.cluster
    assert Knobs.from_recipe(chosen).describe() == best.knobs.describe()
    assert all("=" in o for o in overrides)


def test_nothing_fits_is_a_user_error():
    r = recipe("gpt_3d.yaml", *BIG, "cluster.nodes=1", "cluster.gpus_per_node=1", "training.global_batch_size=8")
    with pytest.raises(UserError, match="none of the .* configurations .* fits"):
        auto_configure(r)


def test_cpu_recipe_cannot_be_ranked():
    with pytest.raises(UserError, match="gpu_peak_tflops"):
        search(load_recipe(REPO / "recipes/gpt_3d.yaml", profile="local"))


def test_search_keeps_the_headroom():
    """No candidate plans into the margin: with the default headroom the ranked candidates all stay under the GPU
    memory less 5 % + 1 GB, and some that would fit in the bare GPU memory are pruned; without headroom they return."""
    base = recipe("gpt_3d.yaml")
    kept = search(base, top=2000, losers=0, use_calibration=False)
    bare = search(recipe("gpt_3d.yaml", "cluster.memory_headroom_gb=0"), top=2000, losers=0, use_calibration=False)
    assert all(c.memory_bytes <= kept.usable_bytes for c in kept.ranked)
    in_margin = [c for c in bare.ranked if kept.usable_bytes < c.memory_bytes <= bare.mem_bytes]
    assert in_margin and kept.too_big > bare.too_big and kept.fitting < bare.fitting


def test_gpt_3d_best_layout_is_pure_data_parallel():
    """1.3B on 16 x 80 GB: TP1 x PP1 x DP16 with the distributed optimizer and both overlaps is the fastest layout
    (issue 12: the layout that reaches >= 45 % MFU); gpt_3d.yaml keeps its 3D layout to demonstrate TP/PP/SP."""
    r = load_recipe(str(REPO / "recipes" / "gpt_3d.yaml"))
    res = search(r, top=3, losers=0, use_calibration=False)
    best = res.best.knobs
    assert (best.layout.tensor_size, best.layout.pipeline_size, best.layout.data_size) == (1, 1, 16)
    assert best.sharding.distributed_optimizer and best.sharding.overlap_grad_reduce
    assert best.sharding.overlap_param_gather
    assert res.best.time.mfu >= 0.45
    as_written = plan_recipe(r, use_calibration=False)
    assert as_written.time.total_s > res.best.step_s  # the recipe's 3D layout is slower, kept on purpose
