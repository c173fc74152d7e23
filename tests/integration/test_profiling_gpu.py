"""On a GPU: event-timed steps, per-step peak memory, NVML telemetry joined to steps, a detected peak (skipped
without CUDA)."""

import json
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _collector(tmp_path, **profiling):
    from hpc_tools.recipe.profiling import ProfilingConfig
    from profiling.collector import StepCollector
    from profiling.peaks import peak_tflops

    peak = peak_tflops(torch.cuda.get_device_name(), "bf16")
    return StepCollector(run_id="gpu", records_dir=tmp_path / "records", rank=0, world_size=1, job_id=None, restart=0,
                         tokens_per_step=1000, coords={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0},
                         config=ProfilingConfig(telemetry_interval_s=0.05, **profiling), cuda=True,
                         model_flops=1e12, hardware_flops=1e12, peak_tflops=peak,
                         device_index=torch.cuda.current_device())


def test_event_timing_memory_and_telemetry(tmp_path):
    c = _collector(tmp_path)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    records = []
    for step in range(1, 6):
        c.start_step(step)
        t0 = time.perf_counter()
        for _ in range(20):
            b = a @ a  # queued asynchronously: a host clock alone would see only the launches
        launch_s = time.perf_counter() - t0
        size = (step % 2 + 1) * 256 * 2**20
        scratch = torch.empty(size, dtype=torch.uint8, device="cuda")
        del scratch, b
        records.append(c.end_step(step))
        assert records[-1]["step_time_s"] > launch_s
    c.close()
    for r in records:
        assert r["mem_allocated_max_bytes"] >= (r["step"] % 2 + 1) * 256 * 2**20  # peak reset every step
        assert r["mfu"] is None or 0 < r["mfu"] < 1
    # Odd steps allocate 512 MiB, even steps 256 MiB: a peak that was not reset would never fall back.
    assert records[0]["mem_allocated_max_bytes"] > records[1]["mem_allocated_max_bytes"]
    assert records[2]["mem_allocated_max_bytes"] > records[1]["mem_allocated_max_bytes"]
    lines = [json.loads(x) for x in (tmp_path / "records" / "telemetry_rank00000.jsonl").read_text().splitlines()]
    assert lines and {"sm_util_pct", "power_w", "sm_clock_mhz", "temperature_c", "mem_used_bytes"} <= set(lines[0])
    assert {row["step"] for row in lines} & set(range(1, 6))
