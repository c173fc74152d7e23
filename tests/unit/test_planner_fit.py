"""fit_violations: silent when the recipe fits (or there is no GPU), one actionable line when it does not."""

from __future__ import annotations

import re

import pytest

from hpc_tools.planner import fit_violations, plan_recipe
from hpc_tools.planner.hardware import GIB
from hpc_tools.recipe.load import load_recipe
from tests.helpers import RECIPES
from tests.unit.inline_recipes import inline_recipe

BIG_GPT = ["model.num_layers=48", "model.hidden_size=8192", "model.num_attention_heads=64",
           "parallel.virtual_pipeline_size=null"]  # ~39 B parameters on 2 x 8 GPUs with TP2 x PP2


def recipe(name: str, *overrides: str):
    """The test's own copy of a production recipe (tests/unit/inline_recipes.py): its numbers are stated here."""
    return inline_recipe(name.removesuffix(".yaml"), *overrides)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_fit(path):
    assert fit_violations(load_recipe(path)) == []
    assert fit_violations(load_recipe(path, profile="local")) == []  # CPU ranks: nothing to check


def test_too_big_names_total_gpu_terms_and_a_fix_that_works():
    r = recipe("gpt_3d.yaml", *BIG_GPT)
    [v] = fit_violations(r)
    plan = plan_recipe(r, use_calibration=False)
    assert plan.fits is False
    assert (v.path, v.value) == ("cluster.gpu_type", r.cluster.gpu_type)
    text = str(v)
    assert f"{plan.memory.total / 1e9:.1f} GB" in text and f"{80 * GIB / 1e9:.1f} GB per GPU" in text  # an H100
    biggest = max(plan.memory.peak.terms, key=plan.memory.peak.terms.get)
    assert biggest in text
    fixes = re.findall(r"((?:\S+=\S+)(?: and \S+=\S+)*) \((\d+\.\d) GB\)", v.fix)
    assert fixes, v.fix
    for change, predicted in fixes:  # every proposed change really fits once applied
        fixed = recipe("gpt_3d.yaml", *BIG_GPT, *change.split(" and "))
        assert fit_violations(fixed) == [], change
        assert f"{plan_recipe(fixed, use_calibration=False).memory.total / 1e9:.1f}" == predicted


def test_more_memory_makes_it_fit_and_override_is_named():
    r = recipe("gpt_zero.yaml", "training.micro_batch_size=16", "cluster.gpu_mem_gb=40")
    [v] = fit_violations(r)
    assert v.path == "cluster.gpu_mem_gb" and v.value == 40
    assert fit_violations(recipe("gpt_zero.yaml", "training.micro_batch_size=16", "cluster.gpu_mem_gb=141")) == []


def test_unknown_gpu_is_reported_with_the_known_ones():
    [v] = fit_violations(recipe("gpt_3d.yaml", "cluster.gpu_type=Z9000"))
    assert v.path == "cluster.gpu_type" and "H100-SXM" in v.fix
    assert fit_violations(recipe("gpt_3d.yaml", "cluster.gpu_type=Z9000", "cluster.gpu_mem_gb=80")) == []


def test_nothing_single_fits_says_so():
    r = recipe("gpt_zero.yaml", "model.num_layers=80", "model.hidden_size=8192", "model.num_attention_heads=64",
               "model.num_query_groups=8", "model.ffn_hidden_size=28672", "backend.deepspeed.zero_stage=0",
               "cluster.nodes=1")
    [v] = fit_violations(r)
    assert "no single change fits" in v.fix


def test_the_fit_keeps_the_headroom():
    """A plan between the GPU memory less the headroom and the GPU memory does not fit; the violation names the
    margin and cluster.memory_headroom_gb moves it."""
    from hpc_tools.planner.hardware import headroom_bytes

    r = recipe("gpt_zero.yaml", "training.micro_batch_size=16", "cluster.gpu_mem_gb=141")
    plan = plan_recipe(r, use_calibration=False)
    total = plan.memory.total / 1e9
    assert headroom_bytes(r.cluster, 141e9) == pytest.approx(0.05 * 141e9 + 1e9)
    just_above = recipe("gpt_zero.yaml", "training.micro_batch_size=16", f"cluster.gpu_mem_gb={total + 1:.3f}")
    [v] = fit_violations(just_above)  # fits in the bare memory, not once the default margin is kept
    assert "headroom" in v.rule and "default: 5%" in v.rule
    assert plan_recipe(just_above, use_calibration=False).fits is False
    no_margin = recipe("gpt_zero.yaml", "training.micro_batch_size=16", f"cluster.gpu_mem_gb={total + 1:.3f}",
                       "cluster.memory_headroom_gb=0.5")
    assert fit_violations(no_margin) == [] and plan_recipe(no_margin, use_calibration=False).fits
