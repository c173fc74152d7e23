"""Pipeline waits by when they happen in the schedule (profiling/breakdown.py ``buckets`` with ``cuts``): the fill and
the drain are the bubble, a steady-state wait on a send/recv is comm.pp, and after its last backward a stage's wait in a
collective that spans stages (the earlier stages still draining) is the bubble beyond the collective's own time; the
CPU plan plays the schedule on the stages' traced work (analysis/breakdown.py)."""

from __future__ import annotations

import pytest

from hpc_tools.analysis import breakdown as ab
from hpc_tools.layout import ParallelLayout
from profiling import breakdown as bd
from tests.unit.inline_recipes import inline_recipe
from tests.unit.test_breakdown import COORDS, ev, trace

B = "autograd::engine::evaluate_function: MmBackward0"


def first_stage():
    """Stage 0 of two, two microbatches (1F1B order F1 F2 B1 B2): F1 0-100, F2 100-200, the fill's wait 200-400, B1
    400-600, the drain's wait 600-700 (the receive buffer allocated first), B2 700-900; then the embedding all-reduce
    (pp) 900-950 and the world's (tp+pp+dp) 950-1000."""
    return [ev("hpc_tools#step 4", 0, 1000),
            ev("aten::linear", 0, 100), ev("aten::linear", 100, 100),
            ev("hpc_tools#comm p2p pg=9", 200, 200), ev("aten::empty", 199, 1), ev("gloo:recv", 201, 199),
            ev(B, 400, 200), ev("aten::mm", 410, 150),
            ev("aten::empty", 600, 1), ev("hpc_tools#comm p2p pg=9", 601, 99), ev("gloo:recv", 602, 98),
            ev(B, 700, 200),
            ev("hpc_tools#comm all_reduce pg=9", 900, 50), ev("hpc_tools#comm all_reduce pg=0", 950, 50)]


def test_fill_and_drain_are_bubble_steady_waits_comm_pp():
    tr = trace(first_stage())
    [t] = bd.timelines(tr)
    assert t.cuts == (400, 400, 900)  # first backward; the drain from there (F2 ended before it); last backward
    dims = bd.group_dims(tr, COORDS)
    b = bd.buckets(t, dims, p2p_floor_us=0.0)
    # every p2p wait here is in the fill (200-400) or the drain (600-700)
    assert b["bubble"] * 1e6 == pytest.approx(200 + 99) and b["comm.pp"] * 1e6 == pytest.approx(50)
    assert b["comm.tp+pp+dp"] * 1e6 == pytest.approx(50)
    assert sum(b.values()) * 1e6 == pytest.approx(1000)


def last_stage():
    """Stage 1 of two (order F1 B1 F2 B2), the first stage slower: the fill's wait for F1 0-100, F1 100-200, B1
    200-400, a steady-state wait for F2 400-500, F2 500-600, B2 600-800; then the embedding all-reduce 800-950, where it
    waits while stage 0 drains, and the world's 950-1000."""
    return [ev("hpc_tools#step 4", 0, 1000),
            ev("hpc_tools#comm p2p pg=9", 0, 100), ev("gloo:recv", 1, 99), ev("aten::linear", 100, 100),
            ev(B, 200, 200), ev("hpc_tools#comm p2p pg=9", 400, 100), ev("gloo:recv", 401, 99),
            ev("aten::linear", 500, 100), ev(B, 600, 200),
            ev("hpc_tools#comm all_reduce pg=9", 800, 150), ev("hpc_tools#comm all_reduce pg=0", 950, 50)]


def test_a_late_stage_waits_for_the_drain_in_a_cross_stage_collective():
    tr = trace(last_stage())
    [t] = bd.timelines(tr)
    assert t.cuts == (200, 600, 800)
    dims = bd.group_dims(tr, COORDS)
    assert bd.tail_us(t, dims) == {"comm.pp": 150, "comm.tp+pp+dp": 50}
    # stage 0, last to arrive, spent 100 us there in all: the 100 us beyond are this rank's wait for the drain
    b = bd.buckets(t, dims, p2p_floor_us=0.0, tail_floor_us=100)
    assert b["bubble"] * 1e6 == pytest.approx(100 + 100)  # the fill's wait and the drain's
    assert b["comm.pp"] * 1e6 == pytest.approx(100 + 150 * 0.5)  # the steady-state wait; the rest of the tail's share
    assert b["comm.tp+pp+dp"] * 1e6 == pytest.approx(50 * 0.5)
    assert sum(b.values()) * 1e6 == pytest.approx(1000)
    assert bd.p2p_wait_s(t) * 1e6 == pytest.approx(200)  # every p2p wait: what the collectors' pp_wait_s sees
    assert bd.pipeline_work_s(t) * 1e6 == pytest.approx(600)  # F1 B1 F2 B2
    [first] = bd.timelines(trace(first_stage()))
    assert bd.pipeline_work_s(first) * 1e6 == pytest.approx(601)  # F1 F2 B1 B2 and the buffer's allocation


def test_cpu_plan_plays_the_schedule_on_the_stages_work():
    """Stage 1 works 1.5x stage 0's (the logits): planned bubble = the schedule's mean fill + drain, not (p-1)/m."""
    recipe = inline_recipe("gpt_3d", "parallel.virtual_pipeline_size=null", "cluster.nodes=1", "cluster.gpu_type=cpu",
                           "cluster.gpus_per_node=4", "training.global_batch_size=8")
    lay = ParallelLayout.from_recipe(recipe)  # TP2 x PP2, m = 4, no peak to time it
    assert (lay.pipeline_size, lay.num_microbatches, lay.interleaved) == (2, 4, False)
    ranks = []
    for rank, stage, work in ((0, 0, 12.0), (1, 0, 12.0), (2, 1, 18.0), (3, 1, 18.0)):
        r = ab.RankBreakdown(rank, {"tp_rank": rank % 2, "pp_rank": stage, "dp_rank": 0})
        r.steps = {3: {"compute": work}, 4: {"compute": work}}
        r.work_s = {3: work, 4: work}
        ranks.append(r)
    planned, source = ab.planned_terms(recipe, lay, ranks)
    # the hand-played timeline of tests/unit/test_pipeline_schedule.py: stage 0 idles 7.5 in fill and drain, stage 1 3
    assert planned == {"bubble": pytest.approx((7.5 + 3.0) / 2)}
    assert "stage 0 12 s, stage 1 18 s" in source
