"""The pipeline bubble under Megatron-core's schedules (hpc_tools/planner/pipeline_schedule.py): equal stages give the
textbook (p-1)/(v m); unequal ones the hand-played 1F1B timeline; the orders match Megatron-core's own."""

from __future__ import annotations

import pytest

from hpc_tools.planner import pipeline_schedule as ps
from hpc_tools.planner.arch import arch_for
from hpc_tools.planner.pipeline_schedule import bubble_fraction, equal_split, simulate, stage_costs, stage_order
from tests.unit.inline_recipes import inline_recipe


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 8), (4, 16), (8, 8)])
def test_equal_stages_reduce_to_p_minus_1_over_m(p, m):
    fwd, bwd = equal_split([3.0] * p)  # f = 1, b = 2 per microbatch
    s = simulate(fwd, bwd, m)
    assert s.step == pytest.approx((m + p - 1) * 3.0)
    for st in s.stages:  # every stage: all its idle time in the fill and the drain, (p-1)/m of its work
        assert st.busy == pytest.approx(3.0 * m)
        assert st.bubble == pytest.approx(st.busy * (p - 1) / m) and st.steady == 0.0


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4)])
def test_equal_interleaved_stages_reduce_to_p_minus_1_over_v_m(p, m, v):
    fwd, bwd = equal_split([3.0] * p, v)
    s = simulate(fwd, bwd, m)
    assert s.step == pytest.approx(3.0 * m * (1 + (p - 1) / (v * m)))
    for st in s.stages:
        assert st.bubble + st.steady == pytest.approx(3.0 * m * (p - 1) / (v * m))


def test_unequal_stages_by_hand():
    """p = 2, m = 4; stage 0: f 1, b 2; stage 1 (holding the logits) 1.5x slower: f 1.5, b 3. Played by hand:
    stage 1 F1 1-2.5, B1 2.5-5.5, F2 5.5-7, B2 7-10, F3 10-11.5, B3 11.5-14.5, F4 14.5-16, B4 16-19; stage 0 F1 0-1,
    F2 1-2, (waits) B1 5.5-7.5, F3 7.5-8.5, (waits) B2 10-12, F4 12-13, (waits) B3 14.5-16.5, (waits) B4 19-21."""
    s = simulate([[1.0], [1.5]], [[2.0], [3.0]], 4)
    assert s.step == 21.0
    first, last = s.stages
    assert (first.busy, first.bubble, first.steady) == (12.0, 3.5 + 1.5 + 2.5, 1.5)  # fill 2-5.5, drain after F4
    assert (last.busy, last.bubble, last.steady) == (18.0, 1.0 + 2.0, 0.0)  # waits for F1, idles while B4 drains
    # the textbook figure on the slowest stage would be 18 / 4 = 4.5: the fast stage waits more, the slow one less
    assert s.mean_bubble == 5.25


def test_orders_are_megatron_cores():
    assert stage_order(2, 0, 4) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("F", 2, 0), ("B", 1, 0), ("F", 3, 0),
                                    ("B", 2, 0), ("B", 3, 0)]
    assert stage_order(2, 1, 2) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    # interleaved p = 2, v = 2, m = 2: warm-up (p-1-s) 2 + (v-1) p = 4 on stage 0, 2 on stage 1
    assert stage_order(2, 0, 2, 2) == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("B", 0, 1), ("B", 1, 1),
                                       ("B", 0, 0), ("B", 1, 0)]
    assert stage_order(2, 1, 2, 2)[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1)]


def test_planner_stage_costs_put_the_logits_last():
    r = inline_recipe("gpt_3d")  # 24 layers, PP2 x VPP2, TP2
    arch = arch_for(r)
    fwd, bwd = stage_costs(arch, 2, 2, None, None, 2)
    assert fwd[0][0] == fwd[0][1] == fwd[1][0] < fwd[1][1]  # six layers a chunk; the output layer on the last chunk
    assert fwd[1][1] - fwd[1][0] == 2 * arch.hidden * arch.padded_vocab(2) / 2
    assert bwd[1][1] == 2 * fwd[1][1]
    # the pipeline then runs at the last stage's pace: it idles less than (p-1)/(v m) of its own work
    assert 0.0 < bubble_fraction(arch, 2, 2, 32, tensor=2) < 1 / 64
    assert bubble_fraction(arch, 1, 1, 32) == 0.0


@pytest.mark.parametrize("p,v,m", [(8, 1, 2048), (4, 3, 1000), (6, 2, 900), (3, 1, 5000)])
def test_a_long_step_extended_from_two_shorter_ones_equals_the_played_one(p, v, m):
    """Past PLAYED ops the bubble comes from two shorter steps extended linearly: the same figure as playing every
    microbatch (the planner's stage costs: equal layers, the logits on the last stage)."""
    arch = arch_for(inline_recipe("gpt_3d"))
    assert 2 * p * v * m > ps.PLAYED  # the extended path
    played = ps.stage_schedule(arch, p, v, m)
    assert ps.bubble_fraction(arch, p, v, m) == pytest.approx(played.step / played.slowest_busy - 1.0, rel=1e-9)


def test_too_many_stages_to_play_take_the_textbook_figure():
    fwd, bwd = equal_split([3.0] * 200)
    fwd[-1][0] *= 1.1
    m = 10 ** 6
    assert ps._bubble(tuple(map(tuple, fwd)), tuple(map(tuple, bwd)), m) == (200 - 1) / m
