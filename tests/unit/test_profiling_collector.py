"""Collector pieces without processes: schema round trip, comm hooks (install, unwrap, restore), summaries,
telemetry absent on CPU, a disabled collector."""

import json
import sys
import types
import warnings

import pandas as pd
import pytest

from profiling import comm
from profiling.clock import Clock
from profiling.records import RecordWriter, comm_path, compact_rank, jsonl_path
from profiling.schema import FIELD_NAMES, REQUIRED, STEP_FIELDS, arrow_schema, validate_record
from profiling.summary import format_comm_line, format_job_line, merge, write_rank

SAMPLE = {"int": 7, "float": 1.5, "str": "x", "bool": True}


def _full_record(step):
    rec = {f.name: SAMPLE[f.type] for f in STEP_FIELDS}
    rec.update(step=step, schema_version=1, restart=0 if step < 3 else 1)
    return rec


def test_schema_round_trip_jsonl_parquet_pandas(tmp_path):
    w = RecordWriter(tmp_path, 3)
    for step in (1, 2):
        w.write(_full_record(step))
    w.close()
    sparse = {k: _full_record(3)[k] for k in REQUIRED}  # optional fields absent -> null
    w2 = RecordWriter(tmp_path, 3)  # a requeue appends
    w2.write(sparse)
    w2.close()
    df = pd.read_parquet(tmp_path / "rank00003.parquet")
    assert list(df.columns) == list(FIELD_NAMES) and df["step"].tolist() == [1, 2, 3]
    kinds = {"int": "i", "float": "f", "bool": "b"}
    for f in STEP_FIELDS:
        if f.type in kinds and f.required:
            assert df[f.name].dtype.kind == kinds[f.type], f.name
        if f.name not in ("step", "schema_version", "restart"):
            assert df[f.name].iloc[0] == SAMPLE[f.type], f.name
    assert df["mfu"].isna().tolist() == [False, False, True]
    assert arrow_schema().field("hardware_flops").nullable


def test_schema_rejects_bad_records():
    rec = _full_record(1)
    with pytest.raises(ValueError, match="step_time_s"):
        validate_record({**rec, "step_time_s": "fast"})
    with pytest.raises(ValueError, match="unknown fields"):
        validate_record({**rec, "mystery": 1})
    with pytest.raises(ValueError, match="run_id"):
        validate_record({k: v for k, v in rec.items() if k != "run_id"})
    with pytest.raises(ValueError, match="skipped"):
        validate_record({**rec, "skipped": 1})


def test_torn_last_line_is_skipped(tmp_path):
    w = RecordWriter(tmp_path, 0)
    w.write(_full_record(1))
    w.close(compact=False)
    with open(jsonl_path(tmp_path, 0), "a") as f:
        f.write('{"step": 2, "run')  # killed mid-write
    compact_rank(tmp_path, 0)
    assert pd.read_parquet(tmp_path / "rank00000.parquet")["step"].tolist() == [1]


@pytest.fixture
def world1():
    """A one-rank gloo group in this process (no subprocess): enough for hooks and P2POp construction."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_hooks_patch_library_bindings_and_restore(world1):
    dist = world1
    orig_all_reduce, orig_cm, orig_p2p = dist.all_reduce, dist._coalescing_manager, dist.P2POp
    fake = types.ModuleType("megatron._hpc_fake")
    fake.dist_all_reduce, fake._coalescing_manager, fake.P2POp = orig_all_reduce, orig_cm, orig_p2p
    sys.modules[fake.__name__] = fake
    tracer = comm.CommTracer(Clock())
    try:
        comm.install(tracer)
        assert dist.all_reduce is not orig_all_reduce and fake.dist_all_reduce is dist.all_reduce
        assert fake._coalescing_manager is dist._coalescing_manager is not orig_cm
        # c10d checks ``op in [isend, irecv]`` and ``op.op is isend``: our P2POp hands it the real isend.
        import torch

        op = dist.P2POp(dist.isend, torch.ones(2), 0)
        assert op.op is dist.distributed_c10d.isend and isinstance(op, orig_p2p)
        buf = torch.ones(10)
        tracer.begin_step(sample=False)
        dist.all_reduce(buf)
        assert tracer.end_step() == []  # unsampled: nothing traced
        tracer.begin_step(sample=True)
        work = dist.all_reduce(buf, async_op=True)
        work.wait()
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(torch.ones(3))
            dist.all_reduce(torch.ones(5))
        cm.wait()
        ops = tracer.end_step()
        assert [(o.kind, o.nbytes, len(o.waits)) for o in ops] == [("all_reduce", 40, 1), ("all_reduce", 32, 1)]
        rows = comm.per_kind(ops, tracer.clock)
        assert rows[0]["calls"] == 2 and rows[0]["bytes"] == 72 and rows[0]["busbw_gbps"] == 0.0  # n=1 moves nothing
    finally:
        comm.uninstall(tracer)
        del sys.modules[fake.__name__]
    assert dist.all_reduce is orig_all_reduce and fake.dist_all_reduce is orig_all_reduce
    assert dist._coalescing_manager is orig_cm and dist.P2POp is orig_p2p


def test_nbytes_and_busbw_factors():
    import torch

    assert comm.nbytes(torch.ones(10, dtype=torch.bfloat16)) == 20
    assert comm.nbytes([torch.ones(3), torch.ones(5)]) == 32
    assert comm.busbw_factor("all_reduce", 4) == 1.5 and comm.busbw_factor("reduce_scatter", 4) == 0.75
    assert comm.busbw_factor("all_to_all", 2) == 0.5 and comm.busbw_factor("broadcast", 16) == 1.0


def test_telemetry_absent_on_cpu_without_noise(tmp_path):
    from profiling.telemetry import TelemetrySampler

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TelemetrySampler(tmp_path, 0, 0, 0.1).start() is None
    assert list(tmp_path.iterdir()) == []


def _write_rank(records, rank, pp, step_s, wait_s, steps=range(1, 6)):
    """Records of one rank: every step takes ``step_s`` (10x in step 1, the warm-up), ``wait_s`` of it pipeline wait;
    one all-reduce of 1 GB in 0.5 s sampled on every step."""
    w = RecordWriter(records, rank)
    comm_rows = []
    for step in steps:
        t = step_s * (10 if step == 1 else 1)
        rec = {**_full_record(step), "restart": 0, "rank": rank, "pp_rank": pp, "step_time_s": t, "pp_wait_s": wait_s,
               "tokens": 1000, "model_flops": 4e12, "hardware_flops": 5e12, "tflops_per_gpu": 4e12 / t / 4 / 1e12,
               "mfu": 4e12 / t / 4 / 2e12, "mem_allocated_max_bytes": 100 + rank + (1000 if step == 1 else 0),
               "loss": 2.0 + rank}
        w.write(rec)
        comm_rows.append({"step": step, "rank": rank, "restart": 0, "kind": "all_reduce", "group_size": 2, "calls": 1,
                          "bytes": 10**9, "time_s": 0.5, "span_s": 0.5})
    w.close()
    with open(comm_path(records, rank), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in comm_rows)


def test_merge_job_summary_reduces_the_records(tmp_path):
    records = tmp_path / "records"
    header = {"run_id": "r", "world_size": 4, "flops_convention": "korthikanti", "bubble_theory": 0.25,
              "warmup_steps": 1}
    for rank, (pp, st, wait) in enumerate([(0, 1.0, 0.30), (0, 1.0, 0.32), (1, 1.2, 0.24), (1, 1.1, 0.242)]):
        _write_rank(records, rank, pp, st, wait)
        write_rank(records, rank, {**header, "rank": rank, "pp_rank": pp, "restart": 0})
    write_rank(records, 9, {**header, "rank": 9, "restart": 1})  # another start's file is left out
    job = merge(tmp_path, 4, restart=0)
    assert job["ranks_reporting"] == [0, 1, 2, 3] and job["flops_convention"] == "korthikanti"
    assert job["steps_measured"] == 4 and job["warmup_steps"] == 1  # step 1 is warm-up
    assert job["step_time_median_s"] == 1.2  # the slowest rank ends the step
    assert job["mfu"] == pytest.approx(4e12 / 1.2 / 4 / 2e12) and job["hfu"] == pytest.approx(5e12 / 1.2 / 4 / 2e12)
    assert job["bubble_share_per_stage"] == {"0": pytest.approx(0.31), "1": pytest.approx(0.21)}
    assert job["bubble_share"] == pytest.approx(0.21) and job["bubble_share_theory"] == pytest.approx(0.2)
    assert job["mem_allocated_peak_bytes"] == 1103  # memory peaks count the warm-up step
    assert job["last_loss"] == pytest.approx(3.5)
    (row,) = job["comm"]  # 4 measured steps x 4 ranks
    assert row["bytes"] == 16 * 10**9 and row["samples"] == 16 and row["busbw_gbps"] == pytest.approx(2.0 * 2 * 1 / 2)
    assert json.loads((tmp_path / "summary.json").read_text())["step_time_median_s"] == 1.2


def test_comm_line_has_only_bandwidths_and_job_line_the_runs_figures_in_one_unit():
    """The collector's periodic line carries what the progress line does not (bus bandwidth of sampled collectives),
    nothing when no collective was timed; the job line: the run's median figures, memory in GB, shares in percent."""
    rows = [{"kind": "all_reduce", "group_size": 4, "busbw_gbps": 1.234}, {"kind": "p2p", "group_size": 2,
                                                                           "busbw_gbps": 9.0}]
    assert format_comm_line(10, rows) == "comm at step 10: all_reduce x4 1.23 GB/s busbw"
    assert format_comm_line(10, None) is None and format_comm_line(10, rows[1:]) is None
    job = {"world_size": 4, "step_time_median_s": 0.294, "tokens_per_s": 1741.0, "tokens_per_s_per_gpu": 435.25,
           "tflops_per_gpu": 123.0, "mfu": None, "flops_convention": "korthikanti", "peak_mem_gb": 0.3912,
           "peak_mem_kind": "rss", "bubble_share_per_stage": {"0": 0.31, "1": 0.2}, "bubble_share": 0.2,
           "bubble_share_theory": 0.2}
    line = format_job_line(job)
    assert line.startswith("4 ranks | 0.294 s/step (median) | 1.74k tok/s (435/gpu) | 123 TFLOP/s/gpu [korthikanti]")
    assert "MFU n/a (unknown peak)" in line and "peak 0.39 GB (rss)" in line and "GiB" not in line, line
    assert "pp wait per stage 0: 31 %, 1: 20 %, bubble 20 % of the step (theory 20 %)" in line, line


def test_disabled_collector_writes_nothing(tmp_path):
    from profiling.collector import StepCollector

    c = StepCollector(run_id="r", records_dir=tmp_path / "records", rank=0, world_size=1, job_id=None, restart=0,
                      tokens_per_step=100, coords={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, enabled=False)
    c.start_step(1)
    rec = c.end_step(1, loss=1.0)
    c.close()
    assert rec["step_time_s"] > 0 and rec["tokens_per_s"] > 0
    assert not (tmp_path / "records").exists() and comm._TRACER is None


def test_host_figures_every_step_cpu_switches_and_collective_wait(world1, tmp_path):
    """Every step, unsampled ones too: the host time held in collectives (sync, async waited, a coalesced block at its
    exit and its wait), the process CPU time and the involuntary switches; a sleep is wall time, not CPU time."""
    import time

    import torch

    from profiling.collector import StepCollector, burn_cpu

    dist = world1
    c = StepCollector(run_id="r", records_dir=tmp_path / "records", rank=0, world_size=1, job_id=None, restart=0,
                      tokens_per_step=100, coords={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0})
    try:
        assert c.tracer is not None and c.tracer.host_wait
        c.start_step(1)  # step 1 is not a sampled step (communication_sample_interval 10)
        seen = [c.tracer.host_wait_s]
        dist.all_reduce(torch.ones(4))
        seen.append(c.tracer.host_wait_s)
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        seen.append(c.tracer.host_wait_s)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(torch.ones(3))
            dist.all_reduce(torch.ones(5))
        seen.append(c.tracer.host_wait_s)
        cm.wait()
        seen.append(c.tracer.host_wait_s)
        time.sleep(0.2)
        burn_cpu(0.1)
        rec = c.end_step(1)
    finally:
        c.close()
    assert all(b > a for a, b in zip(seen, seen[1:])), seen  # each collective and each wait counted
    assert rec["collective_wait_s"] == pytest.approx(seen[-1])
    assert rec["step_time_s"] > 0.3 and 0 < rec["cpu_time_s"] < rec["step_time_s"] - 0.19  # the sleep is off-CPU
    assert isinstance(rec["involuntary_switches"], int) and rec["involuntary_switches"] >= 0
    assert 0 <= rec["host_stall_s"] < rec["step_time_s"]  # never stopped: only what the machine's load took (stall.py)
    validate_record(rec)


def test_injected_delays_name_one_rank_or_every_rank():
    from profiling.collector import injected_delays

    spec = "2:compute:0.3,*:data:0.05,1:data:0.1"
    assert injected_delays(2, spec) == {"compute": 0.3, "data": 0.05}
    assert injected_delays(1, spec) == {"data": pytest.approx(0.15)}
    assert injected_delays(0, spec) == {"data": 0.05} and injected_delays(0, "") == {}
    assert injected_delays(3, "*:save:4,1:save:2") == {"save": 4.0}  # a slow checkpoint folder, per save
    for bad in ("x:data:1", "1:disk:1", "1:data"):
        with pytest.raises(ValueError, match="RANK"):
            injected_delays(0, bad)
