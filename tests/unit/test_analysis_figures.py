"""One owner of the measured figures: the same records reduced by the run summary (summary.json), ``analyze`` and the
calibration give identical figures, and those figures equal a hand computation of the stated rules (warm-up per start,
the last record of a re-run step wins, the slowest rank per step, shares as ratios of sums, memory over every step)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.analysis.records import COLUMNS as ANALYSIS_COLUMNS
from hpc_tools.analysis.report import render_markdown
from hpc_tools.planner.calibrate import read_run
from hpc_tools.testing.synthetic import synthetic_run
from profiling import figures
from profiling.records import RecordWriter, comm_path, rank_files
from profiling.schema import FIELD_NAMES, SCHEMA_VERSION, fields
from profiling.summary import merge, write_rank

RANKS, WARMUP, PEAK = 4, 2, 2.0
TOKENS = 8 * 64  # global batch x seq_length of the recipe below
# Start 0 ran steps 1-8 (checkpoint after 5); the requeued start 1 re-ran 6-10.
STARTS = ((0, range(1, 9)), (1, range(6, 11)))
MEASURED = (3, 4, 5, 8, 9, 10)  # warm-up: 1, 2 (start 0) and 6, 7 (start 1, whose records of 6-8 win)


def _step_time(rank: int, restart: int, step: int) -> float:
    return 0.1 + 0.01 * ((rank * 7 + step * 3 + restart * 5) % 11) + (0.5 if step in (1, 6) else 0.0)


def _record(rank: int, restart: int, step: int) -> dict:
    t = _step_time(rank, restart, step)
    rec = {"schema_version": SCHEMA_VERSION, "run_id": "r", "job_id": "7", "restart": restart, "rank": rank,
           "node": "n0", "tp_rank": 0, "pp_rank": rank // 2, "dp_rank": rank % 2, "step": step, "time": 1.7e9 + step,
           "step_time_s": t, "data_time_s": 0.001 * step, "tokens": TOKENS, "tokens_per_s": TOKENS / t,
           "tokens_per_s_per_gpu": TOKENS / t / RANKS, "model_flops": 4e12, "hardware_flops": 5e12,
           "tflops_per_gpu": 4e12 / t / RANKS / 1e12, "mfu": 4e12 / t / RANKS / (PEAK * 1e12),
           "hfu": 5e12 / t / RANKS / (PEAK * 1e12), "pp_wait_s": (0.3 - 0.1 * (rank // 2)) * t + 0.001 * step,
           "mem_allocated_max_bytes": 1e9 + rank + (5e8 if step == 1 else 0), "mem_reserved_max_bytes": 2e9 + rank,
           "rss_bytes": 3e9}
    rec["mem_allocated_max_bytes"] = int(rec["mem_allocated_max_bytes"])
    rec["mem_reserved_max_bytes"] = int(rec["mem_reserved_max_bytes"])
    rec["rss_bytes"] = int(rec["rss_bytes"])
    if rank >= 2:
        rec["loss"] = 5.0 - 0.1 * step + 0.01 * rank  # the last pipeline stage reports the loss
    if step % 2 == 0:
        rec["comm_time_s"] = 0.02 * t  # collectives timed on sampled steps
    return rec


@pytest.fixture
def run(tmp_path):
    """A run folder (recipe, manifest) whose records were written the way a requeued job writes them."""
    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=4", "training.global_batch_size=8",
                                      f"profiling.warmup_steps={WARMUP}"], np.ones((RANKS, 1)))
    for path in folder.records_dir.iterdir():
        path.unlink()
    for restart, steps in STARTS:
        for rank in range(RANKS):
            writer = RecordWriter(folder.records_dir, rank, validate_every=1)
            for step in steps:
                writer.write(_record(rank, restart, step))
            writer.close()  # compacts: the parquet holds both starts
            with open(comm_path(folder.records_dir, rank), "a") as f:
                for step in steps:
                    if step % 2 == 0:
                        f.write(json.dumps({"step": step, "rank": rank, "restart": restart, "kind": "all_reduce",
                                            "group_size": 2, "calls": 1, "bytes": 1000, "time_s": 0.01,
                                            "span_s": 0.02}) + "\n")
    header = {"run_id": folder.run_id, "world_size": RANKS, "flops_convention": "megatron", "bubble_theory": None,
              "warmup_steps": WARMUP, "restart": 1}
    for rank in range(RANKS):
        write_rank(folder.records_dir, rank, {**header, "rank": rank})
    return folder


def _hand() -> dict:
    """The figures computed by hand from the rules in profiling.figures.DEFINITIONS."""
    last = {}  # (rank, step) -> record, the last one written wins
    for restart, steps in STARTS:
        for rank in range(RANKS):
            for step in steps:
                last[rank, step] = _record(rank, restart, step)
    per_step = np.array([max(last[r, s]["step_time_s"] for r in range(RANKS)) for s in MEASURED])
    med = float(np.median(per_step))
    rank_meds = np.array([np.median([last[r, s]["step_time_s"] for s in MEASURED]) for r in range(RANKS)])

    def share(part, r):
        steps = [s for s in MEASURED if part in last[r, s]]
        return sum(last[r, s][part] for s in steps) / sum(last[r, s]["step_time_s"] for s in steps)

    bubble = {str(p): np.mean([share("pp_wait_s", r) for r in range(RANKS) if r // 2 == p]) for p in (0, 1)}
    return {"steps_measured": len(MEASURED), "step_time_median_s": med,
            "step_time_p90_s": float(np.percentile(per_step, 90)), "tokens_per_s": TOKENS / med,
            "tflops_per_gpu": 4e12 / med / RANKS / 1e12, "mfu": 4e12 / med / RANKS / (PEAK * 1e12),
            "hfu": 5e12 / med / RANKS / (PEAK * 1e12), "peak_tflops_per_gpu": PEAK,
            "data_share": np.mean([share("data_time_s", r) for r in range(RANKS)]),
            "comm_share": np.mean([share("comm_time_s", r) for r in range(RANKS)]),
            "bubble_share_per_stage": bubble, "bubble_share": min(bubble.values()),
            "mem_allocated_peak_bytes": 1e9 + 3 + 5e8, "mem_reserved_peak_bytes": 2e9 + 3,
            "rank_skew": (rank_meds.max() - rank_meds.min()) / np.median(rank_meds),
            "last_loss": np.mean([last[r, 10]["loss"] for r in (2, 3)])}


def _empty(x) -> bool:
    return x is None or x == "" or (isinstance(x, float) and np.isnan(x))


def _same(a, b) -> bool:
    """Equal figures: both empty (None in JSON, NaN or "" in a table), equal text, or equal numbers."""
    if _empty(a) or _empty(b):
        return _empty(a) and _empty(b)
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a == pytest.approx(b, rel=1e-12)


def test_summary_analyze_and_calibrate_give_identical_figures(run):
    job = merge(run.path, RANKS, restart=1)
    row = analyse([str(run.path)]).runs.iloc[0].to_dict()
    measured = read_run(run.path)
    for name in figures.JOB_FIGURES:
        if name == "bubble_share_per_stage":  # a dict in summary.json, text in the table
            continue
        assert _same(job[name], row[name]), (name, job[name], row[name])
    assert measured.steps == job["steps_measured"] and measured.step_time_s == job["step_time_median_s"]
    assert measured.mem_allocated_max_bytes == job["mem_allocated_peak_bytes"]
    assert measured.mem_reserved_max_bytes == job["mem_reserved_peak_bytes"]
    # The per-rank figures too: summary.json's ranks are analyze's rank table.
    ranks = analyse([str(run.path)]).ranks
    for rank in job["ranks"]:
        other = ranks[ranks["rank"] == rank["rank"]].iloc[0]
        for key, value in rank.items():
            assert _same(value, other[key]), (rank["rank"], key)


def test_figures_equal_a_hand_computation_of_the_stated_rules(run):
    job = merge(run.path, RANKS, restart=1)
    hand = _hand()
    for name, value in hand.items():
        if name == "bubble_share_per_stage":
            assert job[name] == pytest.approx(value)
        else:
            assert job[name] == pytest.approx(value, rel=1e-12), name
    steps = analyse([str(run.path)]).steps
    assert sorted(steps.loc[~steps["warmup"], "step"]) == list(MEASURED)
    assert job["comm"][0]["samples"] == RANKS * sum(1 for s in MEASURED if s % 2 == 0)


def test_the_collectors_own_summary_equals_analyze(tmp_path):
    """Real collectors (two starts, four ranks in this process) write records and summary.json; analyze agrees."""
    from hpc_tools.recipe.profiling import ProfilingConfig
    from profiling.collector import StepCollector

    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=4", "training.global_batch_size=8"], np.ones((RANKS, 1)))
    for path in folder.records_dir.iterdir():
        path.unlink()
    config = ProfilingConfig(warmup_steps=WARMUP, communication=False, gpu_telemetry=False)
    for restart, steps in STARTS:
        collectors = [StepCollector(run_id=folder.run_id, records_dir=folder.records_dir, rank=r, world_size=RANKS,
                                    job_id=None, restart=restart, tokens_per_step=TOKENS,
                                    coords={"tp_rank": 0, "pp_rank": 0, "dp_rank": r}, config=config,
                                    model_flops=4e9, hardware_flops=5e9, peak_tflops=PEAK, run_dir=folder.path)
                      for r in range(RANKS)]
        for step in steps:
            for c in collectors:
                c.start_step(step)
                c.end_step(step, loss=1.0)
        for c in reversed(collectors):  # rank 0 last: its merge finds every rank file at once
            c.close()
    job = json.loads((folder.path / "summary.json").read_text())
    row = analyse([str(folder.path)], warmup=WARMUP).runs.iloc[0].to_dict()
    assert job["steps_measured"] == len(MEASURED) and job["restart"] == 1
    for name in figures.JOB_FIGURES:
        if name != "bubble_share_per_stage":
            assert _same(job[name], row[name]), (name, job[name], row[name])


def test_record_names_and_columns_come_from_profiling():
    assert set(ANALYSIS_COLUMNS) <= set(FIELD_NAMES)
    assert ANALYSIS_COLUMNS is figures.COLUMNS
    with pytest.raises(ValueError, match="step_tme_s"):
        fields("step", "step_tme_s")


def test_rank_files_prefer_newer_json_lines(tmp_path):
    w = RecordWriter(tmp_path, 2)
    w.write(_record(2, 0, 1))
    w.close()
    assert rank_files(tmp_path) == {2: tmp_path / "rank00002.parquet"}
    w = RecordWriter(tmp_path, 2)  # a requeued rank killed before it compacted
    w.write(_record(2, 1, 2))
    w.close(compact=False)
    os.utime(tmp_path / "rank00002.parquet", (1, 1))
    assert rank_files(tmp_path) == {2: tmp_path / "rank00002.jsonl"}
    (tmp_path / "rankx.parquet").write_text("")  # not a rank file
    (tmp_path / "summary_rank00002.json").write_text("{}")
    assert list(rank_files(tmp_path)) == [2]


def test_the_report_method_section_states_every_definition(run):
    a = analyse([str(run.path)])
    md = render_markdown(a, [], "t")
    method = md.split("## Method")[1]
    for name in figures.DEFINITIONS:
        assert f"- {name}:" in method
    assert "b / (1 + b)" in method and "last record of a step (the newest start's) wins" in method.replace("\n  ", " ")
