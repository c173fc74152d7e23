"""profiling.trace_ranks: which ranks take the sampled traces (all, auto's cover of a large job, an explicit list).

The cover is checked against Megatron-core's rank order written out here on its own (tp-cp-dp-pp for the dense
groups, etp-ep-edp-pp for the experts, consecutive ranks per node), not against the module's group lists."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_tools.errors import RecipeError
from hpc_tools.layout import ParallelLayout
from profiling.trace_ranks import ALL_UP_TO, cover, traced_ranks

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gpt_3d.yaml"


def layout(t=1, c=1, p=1, d=1, e=1, etp=None, rpn=8) -> ParallelLayout:
    world = t * c * p * d
    return ParallelLayout(nodes=max(world // rpn, 1), ranks_per_node=min(rpn, world), tensor_size=t, pipeline_size=p,
                          data_size=d, virtual_pipeline_size=None, sequence_parallel=False, micro_batch_size=1,
                          global_batch_size=d, context_size=c, expert_size=e, expert_tensor_size=etp)


def keys(lay: ParallelLayout, r: int) -> dict[str, tuple]:
    """The group of each kind rank ``r`` is in (stage, node, and the kinds of more than one rank), named by the
    coordinates its members share."""
    t, c, d = lay.tensor_size, lay.context_size, lay.data_size
    tr, cr, dr, pr = r % t, (r // t) % c, (r // (t * c)) % d, r // (t * c * d)
    etp, e = lay.expert_tensor_size, lay.expert_size
    out = {"stage": (pr,), "node": (r // lay.ranks_per_node,), "tp": (cr, dr, pr), "cp": (tr, dr, pr),
           "dp": (tr, cr, pr), "pp": (tr, cr, dr), "ep": (r % etp, r // (etp * e))}
    sizes = {"tp": t, "cp": c, "dp": d, "pp": lay.pipeline_size, "ep": e}
    return {k: v for k, v in out.items() if sizes.get(k, 2) > 1}  # a one-rank group communicates nothing


@st.composite
def layouts(draw):
    t, c, p = (draw(st.sampled_from(v)) for v in ([1, 2, 4, 8], [1, 2], [1, 2, 3, 4, 8]))
    d = draw(st.sampled_from([1, 2, 4, 6, 16, 32]))
    e = draw(st.sampled_from([x for x in (1, 2, 4, 8) if (t * c * d) % (t * x) == 0] or [1]))
    rpn = draw(st.sampled_from([x for x in (1, 2, 4, 8) if (t * c * p * d) % x == 0]))
    return layout(t, c, p, d, e, None, rpn)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_cover_sees_every_stage_group_and_node_with_few_ranks(lay):
    chosen = cover(lay)
    assert chosen == sorted(set(chosen)) and chosen[0] == 0 and chosen[-1] < lay.world_size
    everyone = [keys(lay, r) for r in range(lay.world_size)]
    seen = [keys(lay, r) for r in chosen]
    largest = 1
    for kind in everyone[0]:
        groups = {k[kind] for k in everyone}
        assert {k[kind] for k in seen} == groups, kind
        largest = max(largest, len(groups))
    # a rank is in one group of each kind: no cover is smaller than the kind with most groups; greedy stays close
    assert largest <= len(chosen) <= math.ceil(1.125 * largest)


def test_cover_of_a_large_job_is_a_subset():
    lay = layout(t=8, p=8, d=16, rpn=8)  # 1024 ranks on 128 nodes: a TP group per node, 128 PP groups
    chosen = traced_ranks(lay, "auto")
    assert len(chosen) == 128 and chosen == cover(lay)
    assert {r // 8 for r in chosen} == set(range(128))  # one per node
    assert {r // 128 for r in chosen} == set(range(8))  # every stage


def test_all_auto_and_lists():
    small, big = layout(t=2, p=2, d=ALL_UP_TO // 4), layout(t=2, p=2, d=ALL_UP_TO // 2)
    assert traced_ranks(small, "auto") == list(range(ALL_UP_TO)) == traced_ranks(small, "all")
    assert len(traced_ranks(big, "auto")) < big.world_size == len(traced_ranks(big, "all"))
    # a list after an elastic shrink: the ranks beyond the world trace nothing
    assert traced_ranks(small, [40, 3, 0, 3]) == [0, 3]


@pytest.mark.parametrize("value, message", [
    ([9], "profiling.trace_ranks=[9] must be ranks of a 4-rank job"),
    ([], "profiling.trace_ranks=[] must be ranks of a 4-rank job"),
])
def test_validate_names_the_field_in_one_line(value, message):
    from hpc_tools.recipe.load import load_recipe

    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, overrides=[f"profiling.trace_ranks={value}"], profile="local")
    line = str(err.value)
    assert message in line and "\n" not in line and "auto, or all" in line


def test_only_the_chosen_ranks_sample(tmp_path):
    """StepCollector.for_rank: a rank outside profiling.trace_ranks takes no sampled trace (gpt_3d, TP2 x PP2, on 8
    nodes of 8: 64 ranks, auto's cover; then a list). One test: the collector's first start imports torch."""
    from types import SimpleNamespace

    from hpc_tools.recipe.load import load_recipe
    from profiling.collector import StepCollector

    for setting in ("auto", "[1]"):
        recipe = load_recipe(RECIPE, [f"profiling.trace_ranks={setting}", "cluster.nodes=8"], check=False)
        lay = ParallelLayout.from_recipe(recipe)
        chosen = traced_ranks(lay, recipe.profiling.trace_ranks)
        assert lay.world_size == 64 and 0 < len(chosen) < 64
        for rank in (0, 1, 63):
            ctx = SimpleNamespace(recipe=recipe, layout=lay, device_type="cpu", rank=rank, is_rank0=rank == 0,
                                  run=SimpleNamespace(run_id="t", records_dir=tmp_path / "records", path=tmp_path),
                                  dist=SimpleNamespace(world_size=64, job_id=None, restart_count=0))
            collector = StepCollector.for_rank(ctx)
            try:
                sampled = collector.trace is not None and collector.trace.every > 0
                assert sampled == (rank in chosen), (setting, rank, chosen)
            finally:
                collector.close()
