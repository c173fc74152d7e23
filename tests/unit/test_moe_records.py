"""The router's figures in the step records, the run's figures, summary.json, analyze and the report (no processes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.analysis.report import render_markdown
from hpc_tools.testing.synthetic import synthetic_run
from profiling import figures
from profiling.records import RecordWriter, comm_path
from profiling.schema import SCHEMA_VERSION, validate_record
from profiling.summary import merge, write_rank

RANKS, WARMUP, STEPS = 2, 1, 6
TOKENS = 8 * 64


def _imbalance(step: int) -> float:
    return 1.0 + 0.1 * step


def _record(rank: int, step: int, moe: bool) -> dict:
    t = 0.1 + 0.01 * step
    rec = {"schema_version": SCHEMA_VERSION, "run_id": "r", "job_id": None, "restart": 0, "rank": rank, "node": "n0",
           "tp_rank": 0, "pp_rank": 0, "dp_rank": rank, "step": step, "time": 1.7e9 + step, "step_time_s": t,
           "tokens": TOKENS, "tokens_per_s": TOKENS / t, "tokens_per_s_per_gpu": TOKENS / t / RANKS,
           "loss": 5.0 - 0.1 * step, "comm_time_s": 0.02}
    if moe:
        rec.update(moe_aux_loss=1.0 + 0.01 * step, moe_load_imbalance=_imbalance(step),
                   moe_tokens_per_expert=json.dumps([100 + step, 100, 100, 100 - step]))
    return rec


def _run(tmp_path, moe: bool):
    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=2", "training.global_batch_size=8",
                                      f"profiling.warmup_steps={WARMUP}"], np.ones((RANKS, 1)))
    for path in folder.records_dir.iterdir():
        path.unlink()
    for rank in range(RANKS):
        writer = RecordWriter(folder.records_dir, rank, validate_every=1)
        for step in range(1, STEPS + 1):
            writer.write(_record(rank, step, moe))
        writer.close()
        with open(comm_path(folder.records_dir, rank), "a") as f:
            for step in range(1, STEPS + 1):
                for kind, time_s in (("all_to_all", 0.004), ("all_reduce", 0.01)):
                    f.write(json.dumps({"step": step, "rank": rank, "restart": 0, "kind": kind, "group_size": 2,
                                        "calls": 2, "bytes": 1000, "time_s": time_s, "span_s": time_s}) + "\n")
        write_rank(folder.records_dir, rank, {"run_id": folder.run_id, "world_size": RANKS, "warmup_steps": WARMUP,
                                              "flops_convention": "megatron", "bubble_theory": None, "restart": 0,
                                              "rank": rank})
    return folder


def test_moe_fields_are_in_the_schema():
    validate_record(_record(0, 1, moe=True))
    bad = {**_record(0, 1, moe=True), "moe_load_imbalance": "high"}
    with pytest.raises(ValueError, match="moe_load_imbalance"):
        validate_record(bad)


def test_router_figures_reduce_by_their_definition_and_reach_summary_analyze_and_report(tmp_path):
    run = _run(tmp_path, moe=True)
    measured = range(WARMUP + 1, STEPS + 1)
    job = merge(run.path, RANKS, restart=0)
    assert job["moe_load_imbalance_median"] == pytest.approx(np.median([_imbalance(s) for s in measured]))
    assert job["moe_load_imbalance_max"] == pytest.approx(_imbalance(STEPS))
    assert job["moe_aux_loss"] == pytest.approx(np.mean([1.0 + 0.01 * s for s in measured]))
    analysis = analyse([str(run.path)])
    row = analysis.runs.iloc[0].to_dict()
    for name in ("moe_load_imbalance_median", "moe_load_imbalance_max", "moe_aux_loss"):
        assert row[name] == pytest.approx(job[name]), name
    # all-to-all: 0.004 s per rank-step (sampled every step here) over the median step time
    median = job["step_time_median_s"]
    assert row["all_to_all_share"] == pytest.approx(0.004 / median)
    text = render_markdown(analysis, [], "t")
    assert "## Mixture of experts" in text
    line = next(x for x in text.splitlines() if "router load imbalance median" in x)
    assert f"{job['moe_load_imbalance_median']:.3g}" in line and f"{100 * 0.004 / median:.1f} %" in line


def test_a_dense_run_has_no_router_figures_and_no_moe_section(tmp_path):
    run = _run(tmp_path, moe=False)
    job = merge(run.path, RANKS, restart=0)
    assert job["moe_load_imbalance_median"] is None and job["moe_aux_loss"] is None
    analysis = analyse([str(run.path)])
    assert "## Mixture of experts" not in render_markdown(analysis, [], "t")
    assert figures.all_to_all_share([], 0.1) is None


def test_the_collector_refuses_a_figure_the_schema_lacks(tmp_path):
    from hpc_tools.recipe.profiling import ProfilingConfig
    from profiling.collector import StepCollector

    config = ProfilingConfig(warmup_steps=0, communication=False, gpu_telemetry=False)
    c = StepCollector(run_id="r", records_dir=tmp_path, rank=0, world_size=1, job_id=None, restart=0,
                      tokens_per_step=TOKENS, coords={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, config=config,
                      run_dir=tmp_path)
    c.start_step(1)
    record = c.end_step(1, loss=1.0, figures={"moe_load_imbalance": 1.5})
    assert record["moe_load_imbalance"] == 1.5
    c.start_step(2)
    with pytest.raises(ValueError, match="moe_imbalance"):
        c.end_step(2, figures={"moe_imbalance": 1.5})
    c.close()
