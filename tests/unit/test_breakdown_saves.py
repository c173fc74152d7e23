"""analyze --breakdown: a traced step that a checkpoint save followed carries the save's blocked time (the collectors'
checkpoint_save event) in its checkpoint bucket and in its measured step, so the buckets still add up; a rank's mean
carries the run's blocked save time per recorded step."""

from __future__ import annotations

import json

import pytest

from hpc_tools.analysis import breakdown as ab


def ev(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def step_events(step, t0):
    """A 1000 us step: data 100, compute 700, nothing 200."""
    return [ev(f"hpc_tools#step {step}", t0, 1000), ev("hpc_tools#data", t0, 100), ev("aten::mm", t0 + 100, 700)]


def lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "profiler").mkdir()
    (tmp_path / "records").mkdir()
    for rank in (0, 1):
        tr = {"distributedInfo": {"rank": rank, "pg_config": []},
              "traceEvents": step_events(200, 0) + step_events(400, 5000)}
        (tmp_path / "profiler" / f"rank{rank:05d}.steps200-400.pt.trace.json").write_text(json.dumps(tr))
        lines(tmp_path / "records" / f"rank{rank:05d}.jsonl",
              [{"step": s, "step_time_s": 0.001, "tp_rank": 0, "pp_rank": 0, "dp_rank": rank}
               for s in (199, 200, 201, 400)])
        # saves after steps 201 (not traced) and 400 (traced; rank 1 blocked longer); a load is no save
        lines(tmp_path / "records" / f"events_rank{rank:05d}.jsonl",
              [{"event": "checkpoint_save", "seconds": 0.3, "step": 201, "rank": rank, "restart": 0},
               {"event": "checkpoint_load", "seconds": 0.2, "step": 200, "rank": rank, "restart": 0},
               {"event": "checkpoint_save", "seconds": 0.5 + rank, "step": 400, "rank": rank, "restart": 0}])
    return tmp_path


def test_saved_step_carries_its_blocked_time(run_dir):
    ranks = ab.measure(run_dir)
    assert [r.rank for r in ranks] == [0, 1]
    for r in ranks:
        blocked = 0.5 + r.rank
        assert r.saved_steps == [400]
        assert r.steps[200]["checkpoint"] == 0.0
        assert r.steps[400]["checkpoint"] == pytest.approx(blocked)
        assert r.step_time_s == pytest.approx({200: 0.001, 400: 0.001 + blocked})
        for s, b in r.steps.items():  # sum-to-step holds on the saved step too
            assert sum(b.values()) == pytest.approx(r.step_time_s[s], rel=1e-6)
        assert r.steps[400]["compute"] == pytest.approx(700e-6)
        # the rank's mean: every save of the run (0.3 + blocked) over its 4 recorded steps, not the traced share
        assert r.mean("checkpoint") == pytest.approx((0.3 + blocked) / 4)
        assert r.measured_step_s == pytest.approx(0.001 + (0.3 + blocked) / 4)
        assert sum(r.buckets().values()) == pytest.approx(r.measured_step_s) == pytest.approx(r.mean_step())


def test_json_and_text_name_the_saved_steps(run_dir):
    ranks = ab.measure(run_dir)
    b = ab.Breakdown("r", ranks, {}, "none", None, ab.verdict(ab.mean_buckets(ranks), {}, None), None)
    js = b.to_json()
    assert [r["saved_steps"] for r in js["ranks"]] == [[400], [400]]
    assert all(r["sum_over_step"] == pytest.approx(1.0) for r in js["ranks"])
    assert js["verdict"].startswith("checkpoint ")  # the largest unplanned bucket: the blocked save
    assert "traced steps a checkpoint save followed: [400]" in ab.format_text(b)
