"""The collectors in real multi-rank gloo jobs (hpc_tools/testing/workload.py): records on every rank, communication
bytes and time on sampled steps, bus bandwidth, a requeue appending to the records, summaries, a torch.profiler trace,
and the pipeline bubble of Megatron-core's own 1F1B schedule."""

import json

import pandas as pd
import pytest

from hpc_tools.testing.workload import launch
from profiling.comm import busbw_factor
from profiling.schema import FIELD_NAMES

WORLD = 2
STEPS, INTERVAL = 6, 2  # then a requeued collector runs steps 7-8 with restart=1
ATTEMPTS = 3


@pytest.fixture(scope="module")
def comm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    results = launch("comm", out, WORLD, "--steps", str(STEPS), "--interval", str(INTERVAL))
    return out / "run", results


def _records(run, rank):
    return pd.read_parquet(run / "records" / f"rank{rank:05d}.parquet")


def test_every_rank_writes_records_that_survive_a_requeue(comm_run):
    run, _ = comm_run
    for rank in range(WORLD):
        df = _records(run, rank)
        assert list(df.columns) == list(FIELD_NAMES)
        assert df["step"].tolist() == list(range(1, STEPS + 3))
        assert df["restart"].tolist() == [0] * STEPS + [1, 1]  # the second collector appended, never truncated
        assert (df["rank"] == rank).all() and (df["dp_rank"] == rank).all()
        assert (df["step_time_s"] > 0).all() and (df["data_time_s"] >= 0.002).all()
        assert df["tokens_per_s"].tolist() == pytest.approx((df["tokens"] / df["step_time_s"]).tolist())
        tflops = df["model_flops"] / df["step_time_s"] / WORLD / 1e12
        assert df["tflops_per_gpu"].tolist() == pytest.approx(tflops.tolist())
        assert df["mfu"].notna().all()  # the workload's recipe sets cluster.gpu_peak_tflops: 1.0
        assert (df["rss_bytes"] > 10 * 2**20).all()
        lines = (run / "records" / f"rank{rank:05d}.jsonl").read_text().splitlines()
        assert len(lines) == STEPS + 2


def test_comm_recorded_only_on_sampled_steps_with_exact_bytes(comm_run):
    run, results = comm_run
    grad_bytes, n = results[0]["grad_bytes"], WORLD
    expected = {"all_reduce": (3, grad_bytes + 4000 + 800), "all_gather": (1, 1024 * n),
                "reduce_scatter": (1, 1024 * n), "broadcast": (1, 512), "p2p": (2, 512)}
    for rank in range(WORLD):
        df = _records(run, rank)
        sampled = df["step"] % INTERVAL == 0
        assert df.loc[sampled, "comm_time_s"].gt(0).all() and df.loc[~sampled, "comm_time_s"].isna().all()
        assert (df.loc[sampled, "comm_bytes"] == sum(b for _, b in expected.values())).all()
        rows = [json.loads(x) for x in (run / "records" / f"comm_rank{rank:05d}.jsonl").read_text().splitlines()]
        assert sorted({r["step"] for r in rows}) == [s for s in range(1, STEPS + 3) if s % INTERVAL == 0]
        for row in rows:
            assert (row["calls"], row["bytes"]) == expected[row["kind"]], row
            assert row["time_s"] > 0 and row["span_s"] >= row["time_s"] * 0.999
            algbw = row["bytes"] / row["span_s"] / 1e9
            assert row["busbw_gbps"] == pytest.approx(algbw * busbw_factor(row["kind"], row["group_size"]))
    assert busbw_factor("all_reduce", 8) == 2 * 7 / 8 and busbw_factor("all_gather", 8) == 7 / 8
    assert busbw_factor("broadcast", 8) == 1.0 and busbw_factor("p2p", 2) == 1.0


def test_summaries_line_and_trace(comm_run):
    run, results = comm_run
    job = json.loads((run / "summary.json").read_text())
    assert job["ranks_reporting"] == [0, 1] and job["flops_convention"] == "megatron"
    assert job["restart"] == 1  # written by the requeued start, over the records of both starts
    assert job["steps_measured"] == (STEPS - 1) + 1  # warm-up (1 step) per start: steps 2-6 and 8
    assert job["tokens_per_s"] == pytest.approx(job["tokens_per_step"] / job["step_time_median_s"])
    assert job["mfu"] == pytest.approx(job["model_flops_per_step"] / job["step_time_median_s"] / WORLD / 1e12)
    assert {c["kind"] for c in job["comm"]} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"}
    for rank in range(WORLD):
        assert (run / "records" / f"summary_rank{rank:05d}.json").is_file()
    log0 = results[0]["log"]
    # at summary_interval the collector logs the bus bandwidth of the step's timed collectives (the progress line
    # carries the rest), and at the end the run's one summary line with its FLOPs convention
    assert "comm at step 2: all_reduce x2 " in log0 and "GB/s busbw" in log0 and "[megatron]" in log0
    assert "comm at step" not in results[1]["log"] and "[megatron]" not in results[1]["log"]  # only rank 0 prints
    traces = list((run / "profiler").glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["rank00000.steps2-3.pt.trace.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= steps
    assert any("all_reduce" in e.get("name", "") or "allreduce" in e.get("name", "") for e in events)


@pytest.mark.megatron
def test_pipeline_bubble_measured_and_shrinks_with_microbatches(tmp_path):
    # A timing property: a machine loaded far past its cores (the rest of the suite beside this test) stretches the
    # waits of 16 microbatches' p2p more than the schedule shrinks them, so up to ATTEMPTS launches measure it; a
    # schedule whose bubble does not shrink fails every one.
    seen = []
    for attempt in range(1, ATTEMPTS + 1):
        out = tmp_path / f"attempt{attempt}"
        results = launch("pipeline", out, WORLD, "--steps", "5", "--microbatches", "2", "16")
        for r in results:
            assert r["bubble"]["2"] > 0 and r["bubble"]["16"] > 0, r["bubble"]
            assert r["theory"] == {"2": 0.5, "16": 1 / 16}
        # The least-waiting stage shows the schedule's own bubble (see profiling/figures.py).
        jobs = {m: json.loads((out / f"m{m}" / "summary.json").read_text()) for m in (2, 16)}
        seen.append((jobs[2]["bubble_share"], jobs[16]["bubble_share"]))
        if jobs[16]["bubble_share"] < jobs[2]["bubble_share"]:
            break
    assert jobs[16]["bubble_share"] < jobs[2]["bubble_share"], f"bubble share (m=2, m=16) per attempt: {seen}"
    assert set(jobs[2]["bubble_share_per_stage"]) == {"0", "1"}
    assert jobs[2]["bubble_share_theory"] == pytest.approx(1 / 3)
