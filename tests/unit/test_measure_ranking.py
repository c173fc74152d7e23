"""Measured layout search without running jobs: the planner's candidates get synthetic run folders with known step
times (records written with the real schema, hpc_tools/testing/synthetic.py), and the ranking, the report, the
calibration feed and the command-line refusals are checked against them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from hpc_tools.cli import main
from hpc_tools.errors import UserError
from hpc_tools.planner.efficiency import efficiency_for, efficiency_key
from hpc_tools.planner.search import search
from hpc_tools.recipe.load import dump_resolved, resolve
from hpc_tools.sweep.measure import (
    CPU_PLANNING_PEAK_TFLOPS,
    NOT_RUN,
    MeasureReport,
    Outcome,
    collect,
    feed_calibration,
    measure_overrides,
    planning_recipe,
    print_measure,
    rank_agreement,
    rank_outcomes,
)
from hpc_tools.testing.synthetic import write_rank_parquet

# The shape of gpt_3d's local profile: a tiny GPT on 4 CPU ranks.
TINY = {
    "name": "tiny_measure",
    "model": {"family": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
              "vocab_size": 512},
    "parallel": {"tensor_size": 2, "pipeline_size": 2, "data_size": -1},
    "training": {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 30, "lr_warmup_iters": 20,
                 "precision": "fp32"},
    "backend": {"kind": "megatron"},
    "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_type": "cpu", "cpus_per_task": 1, "time_limit": "00:10:00",
                "signal_delay_s": 30},
}
WARMUP = 2
MEASURED = 4


def tiny(*overrides: str):
    return resolve(TINY, list(overrides), source="tiny (inline)")


def synthetic_cell(sweep_dir, index: int, recipe, step_s: float, status: str = "completed") -> dict:
    """A sweep.json cell entry and its run folder: every rank's measured steps take ``step_s`` (warm-up 10x)."""
    run_id = f"cand{index}"
    run = sweep_dir / run_id
    (run / "records").mkdir(parents=True)
    (run / "recipe.yaml").write_text(dump_resolved(recipe))
    steps = np.arange(1, WARMUP + MEASURED + 1)
    times = np.where(steps <= WARMUP, 10 * step_s, step_s)
    world = recipe.cluster.nodes * recipe.cluster.gpus_per_node
    for rank in range(world):
        write_rank_parquet(run / "records", rank, run_id, steps, times * (1 - 0.01 * rank), 512, world)
    return {"id": f"c{index:03d}-r0", "cell": index, "run_dir": run_id, "job_id": None, "status": status,
            "reason": "" if status == "completed" else "OutOfMemoryError: synthetic"}


@pytest.fixture()
def measured(tmp_path):
    """Three candidates of the tiny recipe's search; measured step times reverse the predicted order, and a fourth
    candidate ran out of memory."""
    planning, peak = planning_recipe(tiny())
    assert peak == CPU_PLANNING_PEAK_TFLOPS
    ranked = search(planning, top=60, losers=0, efficiency=0.5, use_calibration=False).ranked
    cands = [c for i, c in enumerate(ranked) if i == 0 or c.step_s > ranked[i - 1].step_s * 1.001][:4]
    assert len(cands) == 4  # four candidates the model tells apart
    outcomes = [Outcome(i, c.knobs.describe(), c.knobs.overrides(), c.step_s, c.memory_bytes)
                for i, c in enumerate(cands, 1)]
    sweep = tmp_path / "sweep"
    truth = [0.30, 0.20, 0.10]  # predicted #1 is measured slowest
    cells = [synthetic_cell(sweep, i, tiny(*c.knobs.overrides(), f"profiling.warmup_steps={WARMUP}"), t)
             for i, (c, t) in enumerate(zip(cands, truth))]
    cells.append(synthetic_cell(sweep, 3, tiny(*cands[3].knobs.overrides()), 0.05, status="out_of_memory"))
    collect(outcomes, cells, sweep)
    report = MeasureReport(recipe="tiny_measure", executor="local", profile=None, steps=MEASURED,
                           warmup_steps=WARMUP, efficiency=0.5, efficiency_source="default", outcomes=outcomes,
                           sweep=str(sweep), planning_peak_tflops=peak)
    return report, truth, tmp_path / "calibration.json"


def test_ranking_orders_by_measured_step_time_and_keeps_failures(measured):
    report, truth, _ = measured
    ranked = rank_outcomes(report.outcomes)
    assert [o.predicted_rank for o in ranked] == [3, 2, 1, 4]
    # The slowest rank of each step counts (rank 0 here), after the warm-up steps.
    assert [o.measured_step_s for o in ranked[:3]] == pytest.approx(sorted(truth))
    assert all(o.measured.steps == MEASURED for o in ranked[:3])
    oom = ranked[3]
    assert oom.status == "out_of_memory" and "OutOfMemoryError" in oom.reason and oom.measured_step_s is None
    for o in ranked[:3]:
        assert o.ratio == pytest.approx(o.measured_step_s / o.predicted_step_s)
    agree = rank_agreement(ranked)
    assert agree["pairs"] == 3 and agree["kendall_tau"] == -1.0 and agree["predicted_best_won"] is False


def test_completed_run_without_measured_steps_is_a_failure(tmp_path):
    planning, _ = planning_recipe(tiny())
    cand = search(planning, top=1, losers=0, use_calibration=False).ranked[0]
    outcome = Outcome(1, cand.knobs.describe(), cand.knobs.overrides(), cand.step_s, cand.memory_bytes)
    # All recorded steps are warm-up: nothing measured.
    cell = synthetic_cell(tmp_path, 0, tiny(*cand.knobs.overrides(), f"profiling.warmup_steps={WARMUP + MEASURED}"),
                          0.1)
    collect([outcome], [cell], tmp_path)
    assert outcome.status == "failed" and "warm-up" in outcome.reason and outcome.measured is None


def test_calibration_is_fed_relative_to_the_planning_peak(measured):
    report, truth, store = measured
    feed_calibration(report, store, save=True)
    fitted = report.calibration["fitted"]
    key = efficiency_key(tiny())  # the kind and the attention path: megatron+sdpa (local layers, flash on)
    assert key == "megatron+sdpa"
    assert list(fitted) == [f"cpu/{key}"] and len(fitted[f"cpu/{key}"]["runs"]) == 3
    eff = fitted[f"cpu/{key}"]["efficiency"]
    assert 0 < eff < report.efficiency  # a CPU is far slower than the planning figures
    assert efficiency_for(tiny().cluster, key, store)[0] == pytest.approx(eff)
    assert efficiency_for(tiny().cluster, "megatron", store) is None  # never prices TE layers
    assert efficiency_for(tiny().cluster, "fsdp", store) is None  # a Megatron calibration never prices FSDP
    for o in report.measured:  # the fit's predictions bracket the measured times
        assert o.predicted_step_s_after_fit is not None
        assert o.predicted_step_s_after_fit / o.predicted_step_s == pytest.approx(
            report.outcomes[0].predicted_step_s_after_fit / report.outcomes[0].predicted_step_s, rel=0.5)
    # The runs' own recipes never carry the planning peak (no MFU against a guessed peak).
    for o in report.measured:
        assert o.measured.recipe.cluster.gpu_peak_tflops is None


def test_report_table_and_json(measured, capsys):
    report, truth, store = measured
    feed_calibration(report, store, save=False)
    report.outcomes = rank_outcomes(report.outcomes)
    print_measure(report)
    out = capsys.readouterr().out
    # The table rows come in measured order, failures last and explained below it.
    rows = [line for line in out.splitlines() if "│" in line and line.split("│")[0].strip() in ("1", "2", "3", "-")]
    assert [line.split("│")[1].strip() for line in rows] == ["3", "2", "1", "4"]
    assert f"{truth[2]:.4f}" in rows[0] and f"{truth[0]:.4f}" in rows[2]
    assert "out_of_memory: predicted #4" in out and "OutOfMemoryError" in out
    assert "Kendall tau -1.00" in out and "did not win" in out
    assert f"calibration cpu/megatron+sdpa: efficiency {report.efficiency:g} (default) ->" in out
    assert "not stored" in out
    assert "Apply it: --set parallel.tensor_size=" in out
    data = json.loads(json.dumps(report.as_dict(), default=str))
    assert data["measured"] == 3 and data["failed"] == 1
    assert data["winner"]["predicted_rank"] == 3
    assert [c["measured_step_s"] for c in data["candidates"][:3]] == pytest.approx(sorted(truth))
    assert data["candidates"][3]["status"] == "out_of_memory"


def test_measure_overrides_run_warmup_plus_steps():
    recipe = tiny("profiling.warmup_steps=3")
    extra = measure_overrides(recipe, 5)
    assert "training.train_iters=8" in extra and "checkpoint.interval_iters=0" in extra
    # lr warm-up (20) longer than the 8 steps would break the schedule rule: shortened, and the result resolves.
    assert "training.lr_warmup_iters=8" in extra
    assert tiny("profiling.warmup_steps=3", *extra).training.train_iters == 8
    with pytest.raises(UserError, match="--measure-steps 0"):
        measure_overrides(recipe, 0)


def test_planning_peak_only_for_cpu_without_one():
    gpu = tiny("cluster.gpu_type=H100-SXM")
    assert planning_recipe(gpu) == (gpu, None)
    own = tiny("cluster.gpu_peak_tflops=0.5")
    assert planning_recipe(own)[1] is None
    assert planning_recipe(tiny())[0].cluster.gpu_peak_tflops == CPU_PLANNING_PEAK_TFLOPS


def test_invalid_status_is_never_measured():
    o = Outcome(1, "TP1", [], 0.1, 1.0, status=NOT_RUN, reason="breaks a rule")
    assert rank_outcomes([o]) == [o] and rank_agreement([o])["kendall_tau"] is None


@pytest.mark.parametrize("argv, message", [
    (["plan", "RECIPE", "--measure", "3"], "use it with --search"),
    (["plan", "RECIPE", "--search", "--measure", "0"], "argument --measure: '0' is below 1"),
    (["plan", "RECIPE", "--search", "--measure", "2", "--measure-steps", "0"],
     "argument --measure-steps: '0' is below 1"),
    (["submit", "RECIPE", "--measure", "2"], "use it with --auto"),
    (["submit", "RECIPE", "--auto", "--measure", "2", "--dry-run"], "--dry-run never does"),
])
def test_cli_refusals(argv, message, tmp_path, capsys):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY))
    runs = tmp_path / "runs"
    argv = [str(recipe) if a == "RECIPE" else a for a in argv] + ["--executor", "local", "--runs-dir", str(runs)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not runs.exists()  # nothing written


def test_a_candidate_that_breaks_a_rule_is_kept_with_the_reason():
    from hpc_tools.sweep.measure import _candidate_cells, _grid

    planning, _ = planning_recipe(tiny())
    cands = search(planning, top=2, losers=0, use_calibration=False).ranked[:2]
    # A learning-rate warm-up longer than the run breaks the schedule rule for every candidate.
    cells = _candidate_cells(TINY, "tiny", None, [], ["training.train_iters=5", "training.lr_warmup_iters=9"], cands)
    assert [c.valid for c in cells] == [False, False]
    assert all("training.lr_warmup_iters" in c.reasons[0] for c in cells)
    assert [c.label() for c in cells] == [c.knobs.describe() for c in cands]
    ((axis, values),) = _grid(cells).items()
    assert axis.split(",")[0] == "parallel.tensor_size" and len(values) == 2
