"""Goodput buckets (profiling.goodput) of a hand-made run with a failure and a restart, against hand computation."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.testing.synthetic import synthetic_run
from profiling import goodput
from profiling.records import events_path, jsonl_path

T0 = 1.7e9
WORLD = 2


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(T0 + t, dt.timezone.utc).isoformat(timespec="seconds")


def write_run(tmp_path):
    """Life 0: launched at 0, rank process up at 1, collector at 3, steps 1-5 (1 s each) from 10 every 1.2 s, a
    0.5 s save after step 3, killed after step 5 (the launcher says `failed` at 20). Life 1: launched at 30, a 1.2 s
    preflight ending at 32.5 (before its collector starts), load 1.5 s, steps 4-8 from 40, saves after 6 and 8
    (0.5 s, rank 1 slower: 0.7 s), a 0.05 s health check after step 7, `completed` at 50."""
    run = synthetic_run(tmp_path, [f"cluster.gpus_per_node={WORLD}"], np.ones((WORLD, 1)))
    for r in range(WORLD):
        (run.records_dir / f"rank{r:05d}.parquet").unlink()
    lives = [(0, [1, 2, 3, 4, 5], 10.0, {3: 0.5}, None), (1, [4, 5, 6, 7, 8], 40.0, {6: 0.5, 8: 0.5}, 1.5)]
    for r in range(WORLD):
        with open(jsonl_path(run.records_dir, r), "w") as rec, open(events_path(run.records_dir, r), "w") as ev:
            for restart, steps, first, saves, load in lives:
                base = 0.0 if restart == 0 else 30.0
                if restart and r == 0:  # preflight, before the collector starts: this life's, not the one before
                    ev.write(json.dumps({"event": "preflight", "time": T0 + base + 2.5, "seconds": 1.2, "rank": 0,
                                         "restart": restart}) + "\n")
                ev.write(json.dumps({"event": "start", "time": T0 + base + 3, "process_start": T0 + base + 1,
                                     "restart": restart, "rank": r}) + "\n")
                if load:
                    ev.write(json.dumps({"event": "checkpoint_load", "time": T0 + base + 4.5, "seconds": load,
                                         "step": 3, "restart": restart, "rank": r}) + "\n")
                for i, step in enumerate(steps):
                    end = T0 + first + 1.2 * i + 1.0
                    rec.write(json.dumps({"step": step, "restart": restart, "time": end, "step_time_s": 1.0,
                                          "tokens": 64, "node": "n1"}) + "\n")
                    if step == 7 and r == 0:  # a health check between steps 7 and 8 (rank 0 writes it)
                        ev.write(json.dumps({"event": "health_check", "time": end + 0.15, "step": step,
                                             "seconds": 0.05, "restart": restart, "rank": r}) + "\n")
                    if step in saves:
                        ev.write(json.dumps({"event": "checkpoint_save", "time": end + 0.1, "step": step,
                                             "seconds": saves[step] + (0.2 if r == 1 and restart else 0.0),
                                             "restart": restart, "rank": r}) + "\n")
    manifest = run.manifest()
    manifest.update(state="COMPLETED", events=[
        {"time": iso(0), "event": "launched"}, {"time": iso(2), "event": "started"},
        {"time": iso(20), "event": "failed", "state": "FAILED"}, {"time": iso(30), "event": "launched"},
        {"time": iso(32), "event": "started"}, {"time": iso(50), "event": "completed", "state": "COMPLETED"}])
    (run.path / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_buckets_of_a_run_with_a_failure_and_a_restart(tmp_path):
    run = write_run(tmp_path)
    g = goodput.measure(run.records_dir, run.manifest(), WORLD, gpu=False)
    assert len(g.lives) == 2 and g.unit == "rank"
    secs = g.seconds()
    # Life 0: 0..20; start-up 10; save 0.5; steps 1-3 productive, 4-5 recomputed later (lost). Life 1: 30..50;
    # load 1.5, start-up 40 - 30 - 1.5; saves 0.7 + 0.7 (the slowest rank's); steps 4-8 productive; preflight 1.2
    # before step 1 (out of start-up) and the 0.05 s health check mid-life (not out of start-up).
    expected = {"productive": 3 + 5, "degraded": 0.0, "startup": 10 + 8.5 - 1.2, "preflight": 1.2 + 0.05,
                "checkpoint_load": 1.5, "checkpoint_blocked": 0.5 + 1.4, "recovery": 0.0, "lost_work": 2.0,
                "evaluation": 0.0}
    expected["other"] = 40 - sum(expected.values())
    assert secs == pytest.approx(expected)
    s = g.summary()
    assert s["recomputed_steps"] == 2 and s["checkpoint_saves"] == 3 and s["lives"] == 2
    assert s["requeue_wait_s"] == pytest.approx(10.0)
    assert s["allocation_hours"] == pytest.approx(40 * WORLD / 3600)
    assert s["goodput"] == pytest.approx(8 / 40)
    assert sum(row["share"] for row in g.table() if row["share"] is not None) == pytest.approx(1.0)


@pytest.mark.parametrize("layouts, degraded", [
    ([(2, 0), (1, 3)], [4, 5, 6, 7, 8]),  # life 1 continued on 1 of 2 nodes from step 3
    ([(2, 0), (1, 3), (2, 6)], [4, 5, 6]),  # ... and regrew at step 6
    ([(4, 0), (2, 3), (3, 5)], [4, 5, 6, 7, 8]),  # two shrinks: both below the recipe's 4 nodes
    ([(2, 0)], []),  # never elastic
])
def test_steps_on_fewer_nodes_are_the_degraded_bucket(tmp_path, layouts, degraded):
    """An elastic run's steps trained on fewer nodes (the manifest's layouts) move from productive to degraded;
    goodput counts both; the throughput ratio is the median step time in the recipe's layout over the one on fewer
    nodes."""
    run = write_run(tmp_path)
    manifest = run.manifest()
    manifest["layouts"] = [{"nodes": n, "from_iteration": k, "layout": f"x{n}"} for n, k in layouts]
    slower = 1.0
    for r in range(WORLD):  # the steps on fewer nodes take 4 s instead of 1 s
        path = jsonl_path(run.records_dir, r)
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        for rec in recs:
            if rec["step"] in degraded and rec["restart"] == 1:
                rec["step_time_s"] = 4.0
                slower = 4.0
        path.write_text("".join(json.dumps(rec) + "\n" for rec in recs))
    g = goodput.measure(run.records_dir, manifest, WORLD, gpu=False)
    secs = g.seconds()
    kept = {1: 1.0, 2: 1.0, 3: 1.0, **{s: (4.0 if s in degraded else 1.0) for s in range(4, 9)}}
    assert secs["degraded"] == pytest.approx(sum(v for s, v in kept.items() if s in degraded))
    assert secs["productive"] == pytest.approx(sum(v for s, v in kept.items() if s not in degraded))
    assert g.goodput == pytest.approx((secs["productive"] + secs["degraded"]) / g.allocation_s)
    assert g.degraded_ratio == (pytest.approx(1.0 / slower) if degraded else None)
    assert g.summary()["degraded_ratio"] == g.degraded_ratio


def test_analyze_carries_goodput_per_run_and_in_total(tmp_path):
    run = write_run(tmp_path)
    result = analyse([str(run.path)], warmup=0)
    assert result.runs.iloc[0]["goodput"] == pytest.approx(0.2)
    row = result.goodput.iloc[0]
    assert row["lost_work_s"] == pytest.approx(2.0) and row["recomputed_steps"] == 2
    assert result.goodput_total["goodput"] == pytest.approx(0.2) and result.goodput_total["runs"] == 1
    js = result.to_json()
    assert js["goodput"][0]["requeue_wait_s"] == pytest.approx(10.0)


def test_without_events_files_the_manifest_starts_anchor_the_lives(tmp_path):
    run = write_run(tmp_path)
    for r in range(WORLD):
        events_path(run.records_dir, r).unlink()
    g = goodput.measure(run.records_dir, run.manifest(), WORLD, gpu=True)
    assert len(g.lives) == 2 and g.unit == "GPU"
    assert g.seconds()["lost_work"] == pytest.approx(2.0)
    assert g.seconds()["checkpoint_blocked"] == 0.0  # not measured without the events files


def test_the_report_shows_the_degraded_part_only_where_a_run_trained_on_fewer_nodes():
    import pandas as pd

    from hpc_tools.analysis.report import GOODPUT_SHOWN, goodput_parts

    assert goodput_parts(None) == GOODPUT_SHOWN
    assert goodput_parts(pd.DataFrame({"degraded_hours": [0.0, 0.0]})) == GOODPUT_SHOWN
    parts = goodput_parts(pd.DataFrame({"degraded_hours": [0.0, 0.2], "degraded_ratio": [None, 0.5]}))
    assert parts[:-1] == GOODPUT_SHOWN and parts[-1] == ("#", "config", "degraded_hours", "degraded_ratio")
    assert not any("degraded_hours" in cols for cols in GOODPUT_SHOWN)
