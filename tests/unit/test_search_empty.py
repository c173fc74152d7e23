"""A layout search that finds nothing says which constraint emptied it (the heads, layers, sequence and global batch
the layouts must divide, GPU memory, the recipe rules), with the count each removed, and what would admit a layout;
each "would admit" is checked here by searching again with it."""

from __future__ import annotations

import json
import re

from hpc_tools.cli import main
from hpc_tools.planner.empty import BATCH, LAYERS, MEMORY, RULES, explain_search
from hpc_tools.planner.search import search as plain_search
from hpc_tools.planner.search import search_across
from tests.unit.inline_recipes import inline_recipe

# gpt_3d as a 39B model: nothing fits on one node of 40 GB GPUs (nor two); four nodes admit a layout
BIG = ("model.num_layers=48", "model.hidden_size=8192", "model.num_attention_heads=64", "cluster.nodes=1",
       "cluster.gpu_type=A100-40GB", "training.global_batch_size=64")


def recipe(*overrides: str):
    return inline_recipe("gpt_3d", *overrides, check=False)


def search(r, **kw):
    """The search, explained when it ranks nothing (as `plan --search` does)."""
    result = plain_search(r, **kw)
    result.why_none = explain_search(r, result)
    return result


def funnel_adds_up(why) -> None:
    layouts = [s for s in why.steps if s.unit == "layouts"]
    for prev, nxt in zip(layouts, layouts[1:]):
        assert prev.left == nxt.removed + nxt.left, why.steps


def test_the_global_batch_that_no_data_parallel_size_divides_is_named_with_one_that_would():
    # one layer and one head leave TP1 PP1 only, so DP = 16 GPUs, which does not divide a batch of 7
    r = recipe("model.num_layers=1", "model.num_attention_heads=1", "training.global_batch_size=7")
    result = search(r, use_calibration=False)
    why = result.why_none
    assert result.best is None and why.emptied_by == BATCH
    funnel_adds_up(why)
    steps = {s.constraint: s for s in why.steps}
    assert steps[LAYERS].removed > 0 and "PP left: 1" in steps[LAYERS].detail
    assert steps[BATCH].left == 0 and "DP 16 do not divide training.global_batch_size=7" in steps[BATCH].detail
    (admit,) = why.admit
    batch = int(re.search(r"training\.global_batch_size=(\d+)", admit).group(1))
    assert batch == 16
    assert search(recipe("model.num_layers=1", "model.num_attention_heads=1", f"training.global_batch_size={batch}"),
                  use_calibration=False).best is not None


def test_memory_names_the_leanest_and_the_nodes_that_admit_a_layout():
    result = search(recipe(*BIG), use_calibration=False)
    why = result.why_none
    assert result.best is None and why.emptied_by == MEMORY and result.fitting == 0
    funnel_adds_up(why)
    gpu = next(a for a in why.admit if a.startswith("a GPU with at least"))
    need = float(re.search(r"at least (\d+) GB", gpu).group(1))
    assert need * 1e9 >= result.smallest_too_big.memory_bytes + result.headroom_bytes
    nodes = next(a for a in why.admit if a.startswith("cluster.nodes="))
    n = int(re.match(r"cluster\.nodes=(\d+)", nodes).group(1))
    assert n > 1
    assert search(recipe(*BIG[:-3], f"cluster.nodes={n}", *BIG[-2:]), use_calibration=False).best is not None
    assert search(recipe(*BIG[:-3], f"cluster.nodes={n // 2}", *BIG[-2:]), use_calibration=False).best is None
    # a GPU of the size named admits the leanest configuration; 2 GB less does not
    assert search(recipe(*BIG, f"cluster.gpu_mem_gb={need}"), use_calibration=False).best is not None
    assert search(recipe(*BIG, f"cluster.gpu_mem_gb={need - 2}"), use_calibration=False).best is None


def test_a_rule_every_fitting_configuration_breaks_is_named_with_its_fix():
    result = search(recipe("training.min_lr=1"), use_calibration=False)
    why = result.why_none
    assert result.best is None and why.emptied_by == RULES and result.fitting > 0
    assert any("training.min_lr" in a and "use a value <= " in a for a in why.admit)


def test_a_search_that_ranks_something_has_no_explanation():
    assert search(recipe(), use_calibration=False).why_none is None


def test_across_kinds_the_recipe_s_own_kind_is_explained():
    kinds = ["megatron", "fsdp"]
    result = search_across(recipe(*BIG), kinds, use_calibration=False)
    result.why_none = explain_search(recipe(*BIG), result, kinds, use_calibration=False)
    assert result.best is None and result.why_none.kind == "megatron" and result.why_none.emptied_by == MEMORY
    assert result.why_none.lines()[0].startswith("why nothing fits (megatron): the memory constraint")


def test_cli_text_and_json_say_why(capsys, tmp_path):
    from hpc_tools.recipe.load import dump_resolved

    path = tmp_path / "big.yaml"
    path.write_text(dump_resolved(recipe(*BIG)))
    assert main(["plan", str(path), "--search", "--no-calibration"]) == 1
    out = capsys.readouterr().out
    assert "why nothing fits: the memory constraint emptied the search" in out
    assert "would admit a layout: cluster.nodes=" in out
    assert main(["plan", str(path), "--search", "--no-calibration", "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False and d["why_none"]["emptied_by"] == MEMORY
    assert [s["constraint"] for s in d["why_none"]["steps"]][:4] == ["attention heads", "layers", "sequence",
                                                                     "global batch"]
