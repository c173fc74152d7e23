"""The breakdown's arithmetic on synthetic traces (profiling/breakdown.py) and its verdict (analysis/breakdown.py):
overlap, nesting, groups, p2p, CPU and GPU timelines. The same code on real gloo traces: the integration test
tests/integration/test_breakdown_runs.py."""

from __future__ import annotations

import gzip
import json

import pytest

from hpc_tools.analysis import breakdown as ab
from profiling import breakdown as bd
from profiling.trace import trace_paths

MAIN, W_DP, W_TP = 1, 2, 3
COORDS = {0: {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, 1: {"tp_rank": 1, "pp_rank": 0, "dp_rank": 0},
          2: {"tp_rank": 0, "pp_rank": 1, "dp_rank": 0}, 3: {"tp_rank": 1, "pp_rank": 1, "dp_rank": 0},
          4: {"tp_rank": 0, "pp_rank": 0, "dp_rank": 1}}
PGS = [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3, 4]},
       {"pg_name": "7", "pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [0, 1]},
       {"pg_name": "8", "pg_desc": "", "ranks": [0, 4]},          # no description: the coordinates say dp
       {"pg_name": "9", "pg_desc": "PIPELINE_MODEL_PARALLEL_GROUP", "ranks": [0, 2]},
       {"pg_name": "10", "pg_desc": "", "ranks": [0, 1, 2, 3]}]   # tp and pp vary: a mixed group


def ev(name, ts, dur, tid=MAIN, **extra):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, **extra}


def trace(events, rank=0):
    return {"distributedInfo": {"rank": rank, "pg_config": PGS}, "traceEvents": events}


def cpu_step():
    """0-1000 us: data 0-100; compute 100-400 (an op nested in another); a synchronous TP collective 400-600 (its
    gloo op inline on the main thread); an async DP all-reduce called 600-610, run by its worker 620-900 while
    compute runs 610-800; nothing 900-1000."""
    return [ev("hpc_tools#step 5", 0, 1000), ev("ProfilerStep#5", 0, 1000),
            ev("hpc_tools#data", 0, 100), ev("aten::randint", 10, 50),
            ev("aten::linear", 100, 300), ev("aten::mm", 120, 200),
            ev("hpc_tools#comm all_gather pg=7", 400, 200), ev("c10d::allgather_", 401, 5),
            ev("gloo:all_gather", 410, 185, tid=W_TP),
            ev("hpc_tools#comm all_reduce pg=8", 600, 10), ev("aten::mul", 610, 190),
            ev("gloo:all_reduce", 620, 280, tid=W_DP)]


def test_cpu_sweep_overlap_nesting_and_groups():
    tr = trace(cpu_step())
    [t] = bd.timelines(tr)
    assert (t.step, t.start, t.end) == (5, 0, 1000)
    b = bd.buckets(t, bd.group_dims(tr, COORDS))
    us = {k: round(v * 1e6, 6) for k, v in b.items() if v}
    # compute 100-400 and 610-800 (the nested mm counted once, randint is data); the DP op's exposed part 800-900
    # plus its call 600-610; the TP call 400-600 covers its own worker op
    assert us == {"data": 100, "compute": 300 + 190, "comm.tp": 200, "comm.dp": 10 + 100, "host": 100}
    assert sum(b.values()) == pytest.approx(1e-3)


def test_two_groups_in_flight_share_the_time():
    events = [ev("hpc_tools#step 1", 0, 100), ev("hpc_tools#comm all_reduce pg=7", 0, 1),
              ev("gloo:all_reduce", 0.5, 40, tid=W_TP),
              ev("hpc_tools#comm all_reduce pg=8", 1, 1), ev("gloo:all_reduce", 2, 98, tid=W_DP)]
    tr = trace(events)
    b = bd.buckets(bd.timelines(tr)[0], bd.group_dims(tr, COORDS))
    # 0-1 the tp call, 1-2 the dp call (the main thread is in it); 2-40.5 both in flight: shared; 40.5-100 dp alone
    assert b["comm.tp"] * 1e6 == pytest.approx(1 + 38.5 / 2)
    assert b["comm.dp"] * 1e6 == pytest.approx(1 + 38.5 / 2 + 59.5)
    assert sum(b.values()) * 1e6 == pytest.approx(100)


def test_worker_thread_takes_the_group_its_marks_name():
    """Three DP all-reduces run by one worker, each called just before; a TP call lands between the second DP
    call and its op: the thread's vote is still DP, and its op is in flight from the DP call at 300."""
    events = [ev("hpc_tools#step 1", 0, 1000), ev("hpc_tools#comm all_gather pg=7", 304, 1)]
    for i in range(3):
        events += [ev("hpc_tools#comm all_reduce pg=8", 300 * i, 2), ev("gloo:all_reduce", 300 * i + 5, 100, tid=W_DP)]
    tr = trace(events)
    b = bd.buckets(bd.timelines(tr)[0], bd.group_dims(tr, COORDS))
    assert b["comm.dp"] * 1e6 == pytest.approx(105 + 4 + 100 + 105)
    assert b["comm.tp"] * 1e6 == pytest.approx(1)
    assert b["host"] * 1e6 == pytest.approx(1000 - 315)


def test_pipeline_p2p_splits_into_transfer_and_bubble():
    events = [ev("hpc_tools#step 2", 0, 1000), ev("aten::mm", 0, 500),
              ev("hpc_tools#comm p2p pg=9", 500, 2), ev("gloo:recv", 501, 300),   # waited for the other stage
              ev("hpc_tools#comm p2p pg=9", 810, 2), ev("gloo:send", 811, 20), ev("aten::mm", 831, 169)]
    tr = trace(events)
    t = bd.timelines(tr)[0]
    b = bd.buckets(t, bd.group_dims(tr, COORDS))
    assert b["comm.pp"] * 1e6 == pytest.approx(2 * 20)          # two transfers at the fastest one's time
    assert b["bubble"] * 1e6 == pytest.approx(301 + 21 - 40)  # the rest of the exposed p2p (500-801, 810-831)
    floor = bd.buckets(t, bd.group_dims(tr, COORDS), p2p_floor_us=5)  # a faster peer's transfer: more bubble
    assert floor["comm.pp"] * 1e6 == pytest.approx(10) and floor["bubble"] > b["bubble"]


def test_group_dimensions_from_description_then_coordinates():
    dims = bd.group_dims(trace([]), COORDS)
    assert dims == {"0": "tp+pp+dp", "7": "tp", "8": "dp", "9": "pp", "10": "tp+pp", "horovod": "dp"}
    assert bd.dimension("CONTEXT_PARALLEL_GROUP", [0, 1], COORDS) == "cp"
    assert bd.dimension("EXPERT_MODEL_PARALLEL_GROUP", [0, 1], COORDS) == "ep"
    assert bd.dimension("TENSOR_AND_DATA_PARALLEL_GROUP", [0, 1, 4], COORDS) == "tp+dp"
    assert bd.dimension("", [3], COORDS) == "self"


def test_gpu_kernels_are_the_timeline():
    """GPU: compute kernels, NCCL kernels with their process group in the args; host marks count only while no
    kernel runs; a host-side operator is not compute."""
    k = {"cat": "kernel"}
    events = [ev("hpc_tools#step 3", 0, 1000), ev("aten::mm", 0, 900), ev("hpc_tools#data", 0, 100),
              ev("sm90_gemm", 50, 450, tid=7, **k),
              ev("ncclDevKernel_AllReduce_Sum_f32", 400, 300, tid=8, args={"Process Group Name": "8"}, **k),
              ev("ncclDevKernel_SendRecv", 750, 50, tid=9, args={"Process Group Name": "9"}, **k),
              ev("Memcpy DtoH", 850, 50, tid=7, cat="gpu_memcpy")]
    tr = trace(events)
    assert bd.is_gpu(tr)
    b = bd.buckets(bd.timelines(tr)[0], bd.group_dims(tr, COORDS), gpu=True)
    us = {k: round(v * 1e6, 6) for k, v in b.items() if v}
    # data 0-50 (no kernel yet); compute 50-500; dp 500-700 exposed; p2p 750-800 all transfer (its own floor);
    # gaps 700-750 and 900-1000 host; the copy 850-900 other
    assert us == {"data": 50, "compute": 450, "comm.dp": 200, "comm.pp": 50, "host": 50 + 50 + 100, "other": 50}


def _rank(rank, compute, **buckets):
    r = ab.RankBreakdown(rank, COORDS[rank])
    r.steps[5] = {"compute": compute, "comm.tp": 0.0, "bubble": 0.0, "comm.pp": 0.0, "comm.dp": 0.0, **buckets}
    r.step_time_s[5] = sum(r.steps[5].values())
    return r


def test_verdict_names_the_gap_and_the_slow_rank():
    ranks = [_rank(0, 0.1, **{"comm.tp": 0.05}), _rank(1, 0.1, bubble=0.2), _rank(2, 0.1, **{"comm.tp": 0.2}),
             _rank(3, 0.3)]
    strag = ab.straggler(ranks)
    assert strag["rank"] == 3 and strag["over_median_s"] == pytest.approx(0.2)
    assert {(w["rank"], w["group"]) for w in strag["waiting"]} == {(1, "pp"), (2, "tp")}
    line = ab.verdict(ab.mean_buckets(ranks), {"bubble": 0.01}, strag)
    assert line.startswith("comm.tp ") and "not planned" in line and "parallel.tensor_size" in line
    assert "Rank 3's compute is the longest" in line and "rank 2 in tp (0.2 s)" in line
    even = ab.straggler([_rank(0, 0.1), _rank(1, 0.101)])
    assert "longest" not in ab.verdict({"bubble": 0.3}, {"bubble": 0.1}, even)


def test_trace_files_found_plain_and_gzipped(tmp_path):
    folder = tmp_path / "profiler"
    folder.mkdir()
    (folder / "rank00000.steps5-6.pt.trace.json").write_text(json.dumps(trace(cpu_step())))
    with gzip.open(folder / "rank00001.steps200-200.pt.trace.json.gz", "wt") as f:
        json.dump(trace(cpu_step(), rank=1), f)
    (folder / "notes.txt").write_text("")
    paths = trace_paths(tmp_path)
    assert [p.name for p in paths] == ["rank00000.steps5-6.pt.trace.json", "rank00001.steps200-200.pt.trace.json.gz"]
    assert [bd.trace_rank(bd.read_trace(p)) for p in paths] == [0, 1]


def test_waterfall_plot_lays_out(tmp_path):
    from hpc_tools.analysis.plots import kept, layout_problems, step_waterfall

    measured = {"compute": 0.2, "comm.tp": 0.3, "comm.dp": 0.0, "bubble": 0.2, "data": 0.1, "host": 0.04}
    planned = {"compute": 0.15, "comm.tp": 0.05, "bubble": 0.05}
    with kept() as figures:
        [path] = step_waterfall(measured, planned, "run: one step, planned vs measured", tmp_path / "w.png")
        (fig, _), = figures
        assert layout_problems(fig) == []
        ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        tops = sorted(b.get_y() + b.get_height() for b in fig.axes[0].patches)
    assert path.stat().st_size > 0
    assert ticks == ["compute", "comm.tp", "bubble", "data", "host"]
    assert tops[-1] == pytest.approx(sum(measured.values()))  # the measured bars end at the step


def test_report_section_empty_without_traced_runs():
    from hpc_tools.analysis import breakdown_report

    class Bare:  # an analysis the report section was not told the runs of
        pass

    assert breakdown_report.markdown(Bare(), str) == [] and breakdown_report.html_parts(Bare(), str) == []


def test_sampled_and_explicit_windows_write_marked_traces(tmp_path):
    """profiling.trace.Traces on one process: the explicit window (step 3) and a sampled step every 2 after the
    warm-up (1): steps 2 and 4, gzipped, none for step 3; each trace holds its step's mark and the data mark."""
    import torch

    from profiling import trace as tr

    traces = tr.Traces(tmp_path / "profiler", 0, False, (3, 1), every=2, warmup=1)
    for step in range(1, 6):
        traces.start_step(step)
        assert tr.recording() == (step in (2, 3, 4))
        with tr.span(tr.DATA):
            x = torch.ones(64, 64)
        (x @ x).sum()
        traces.end_step(step)
    traces.close()
    assert not tr.recording()
    names = [p.name for p in tr.trace_paths(tmp_path)]
    assert names == ["rank00000.steps2-2.pt.trace.json.gz", "rank00000.steps3-3.pt.trace.json",
                     "rank00000.steps4-4.pt.trace.json.gz"]
    for path, step in zip(tr.trace_paths(tmp_path), (2, 3, 4)):
        [t] = bd.timelines(bd.read_trace(path))
        b = bd.buckets(t, {})
        assert t.step == step and b["data"] > 0 and b["compute"] > 0
        assert sum(b.values()) == pytest.approx((t.end - t.start) / 1e6)


def test_planned_buckets_are_the_planners_terms():
    """A GPU recipe: every term of the plan lands in one bucket (the sum is the planned step), the bubble and the
    TP term one to one; a term the map does not know would land in 'other' and break the first equality's use."""
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.planner import plan_recipe
    from hpc_tools.recipe.load import load_recipe
    from tests.helpers import REPO

    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", [])
    plan = plan_recipe(recipe)
    planned, source = ab.planned_terms(recipe, ParallelLayout.from_recipe(recipe), [])
    assert set(plan.time.terms) <= set(ab._TERM_BUCKET), set(plan.time.terms) - set(ab._TERM_BUCKET)
    assert sum(planned.values()) == pytest.approx(plan.time.total_s)
    # the term is the slowest stage's idle time; the bucket the mean over stages, a faster stage idling longer
    assert planned["bubble"] > plan.time.terms["pipeline bubble"] > 0
    assert planned["compute"] < plan.time.terms["compute"]  # the mean stage's compute, not the slowest's
    assert planned["comm.tp"] == pytest.approx(plan.time.terms["tensor-parallel comm"]) and planned["comm.tp"] > 0
    assert planned["data"] == 0.0 and recipe.cluster.gpu_type in source
