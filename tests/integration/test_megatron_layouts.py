"""Numerical equality of Megatron-core layouts, and resume, from one shared initial checkpoint (dropout 0).

All cases run in ONE launch of 4 gloo ranks (tests/integration/megatron_driver.py); each case loads the same
TP1xPP1 checkpoint, trains 6 steps on the same global batches (micro 1, global 8) and reports the global-batch loss.

Tolerance: LOSS_ATOL = 2e-6 absolute on losses near 6.2, i.e. 4 float32 ulps. Layouts only change the order of
floating-point sums (data-parallel reduction, TP partial sums), measured at most 2 ulps (9.5e-7) on this machine.
A resume in the same layout must be bit-identical. bf16 (Float16Module, fp32 master weights) is held to
BF16_ATOL = 5e-3 against the fp32 run: bf16 keeps 8 significant bits, measured within 4e-4 over 6 steps here.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from hpc_tools.layout import ParallelLayout
from tests.helpers import run_driver

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_driver as driver  # noqa: E402

LOSS_ATOL = 2e-6
BF16_ATOL = 5e-3

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    t0 = time.monotonic()
    data = run_driver("megatron_driver.py", tmp_path_factory.mktemp("mg_layouts") / "results.json", timeout=1500)
    _print_table(data, time.monotonic() - t0)
    return data


def _reference(case: str) -> str:
    return driver.FAMILIES[driver.family_of(case)]


def _print_table(data: dict, wall_s: float) -> None:
    print(f"\nlayout equality ({wall_s:.0f} s for one 4-rank launch); first/last loss, mean step time")
    for case, r in data.items():
        step_s = r.get("step_s")
        timing = f"{sum(step_s) / len(step_s):.3f} s/step" if step_s else f"resumed at step {r['resumed_at']}"
        print(f"  {case:40s} {r['losses'][0]:.7f} {r['losses'][-1]:.7f}  {timing}")


@pytest.mark.parametrize("case", [c for c in driver.CASES if not c.endswith("(DP4)")])
def test_layout_matches_tp1_pp1(results, case):
    got, want = results[case]["losses"], results[_reference(case)]["losses"]
    assert len(got) == len(want) == driver.STEPS
    diffs = [abs(a - b) for a, b in zip(got, want)]
    assert max(diffs) <= (BF16_ATOL if "bf16" in case else LOSS_ATOL), f"{case}: {got} vs {want}"


def test_a_closed_engine_takes_its_process_groups_threads_with_it(results):
    """Each case builds its own parallel state (~25 gloo groups, 2-3 threads each) and closes it: the threads after
    the last case are those after the first (a leak kept ~50 more per case and rank, and slowed the whole suite)."""
    counts = [r["threads"] for r in results.values() if "threads" in r]
    assert len(counts) >= 2, counts
    assert max(counts) - counts[0] <= 8, counts


@pytest.mark.parametrize("family", list(driver.FAMILIES.values()))
def test_loss_falls(results, family):
    losses = results[family]["losses"]
    assert losses[-1] < losses[0] - 0.1, losses


SAME = [n for n, (before, after) in driver.RESUMES.items() if before == after]


@pytest.mark.parametrize("name", SAME)
def test_resume_same_layout_is_bit_identical(results, name):
    r = results[name]
    assert r["resumed_at"] == driver.RESUME_AT
    assert r["losses"] == results[r["reference"]]["losses"]


@pytest.mark.parametrize("case, stages", [("PP2xDP2 uneven (first 1)", [[1], [2, 3, 4]]),
                                          ("TP2xPP2 uneven (last 1)", [[1, 2, 3], [4]])])
def test_uneven_stages_hold_the_layers_they_were_given(results, case, stages):
    """The ranks of each stage built the layers the split gives them (Megatron-core's layer numbers), which are
    also the planner's (layout.pipeline_chunks): an even split under another name would give [1, 2] and [3, 4]."""
    family, sets = driver.CASES[case]
    recipe = driver.make_recipe(family, sets)
    layout = ParallelLayout.from_recipe(recipe)
    planned = [[i + 1 for chunk in stage for i in chunk] for stage in layout.stage_chunks(recipe.model.num_layers)]
    assert planned == stages
    built = {tuple(layers) for layers in results[case]["layers"]}
    assert built == {tuple(s) for s in stages}, results[case]["layers"]


@pytest.mark.parametrize("name", [n for n in driver.RESUMES if n not in SAME])
def test_resume_into_another_layout(results, name):
    r = results[name]
    want = results[r["reference"]]["losses"]
    assert r["resumed_at"] == driver.RESUME_AT
    assert r["losses"][: driver.RESUME_AT] == want[: driver.RESUME_AT]
    assert max(abs(a - b) for a, b in zip(r["losses"], want)) <= LOSS_ATOL, (r["losses"], want)
