"""Horovod in the breakdown: the training thread's wait for Horovod's gradient all-reduces (synchronize(), marked by
profiling.trace.horovod_wait) is exposed data-parallel communication (comm.dp), not host time. Horovod runs the
all-reduces in its own background thread, outside torch.distributed and outside the trace's operators: without the
mark the wait is a gap in the trace."""

from __future__ import annotations

import pytest

from profiling import breakdown as bd
from profiling.trace import TraceWindow, horovod_wait

MAIN = 1
WORLD = [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1]}]


def ev(name, ts, dur, tid=MAIN):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def test_marked_wait_is_comm_dp_on_a_synthetic_trace():
    """0-1000 us: backward 0-600, the synchronize() wait 600-900 (nothing runs on the main thread), update
    900-1000; and the same step without the mark: the wait is host time."""
    body = [ev("hpc_tools#step 3", 0, 1000), ev("aten::mm", 0, 600), ev("Optimizer.step#AdamW.step", 900, 100)]
    for mark, expect in (([ev("hpc_tools#comm all_reduce pg=horovod", 600, 300)], "comm.dp"), ([], "host")):
        tr = {"distributedInfo": {"rank": 0, "pg_config": WORLD}, "traceEvents": body + mark}
        [t] = bd.timelines(tr)
        b = bd.buckets(t, bd.group_dims(tr, {}))
        us = {k: round(v * 1e6, 6) for k, v in b.items() if v}
        assert us == {"compute": 700, expect: 300}


def test_marked_wait_in_a_recorded_trace(tmp_path):
    """A real torch.profiler window around a real Horovod step (one process: Horovod's gloo controller, size 1):
    the mark is recorded on the training thread and the sweep puts exactly its time in comm.dp."""
    torch = pytest.importorskip("torch")
    hvd = pytest.importorskip("horovod.torch")
    hvd.init()
    try:
        model = torch.nn.Linear(256, 256)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        x = torch.randn(32, 256)
        window = TraceWindow(tmp_path, 0, start_step=1, num_steps=1)
        for step in (0, 1):
            window.start_step(step)
            opt.zero_grad()
            model(x).sum().backward()
            with horovod_wait():
                opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
            window.end_step(step)
    finally:
        hvd.shutdown()
    tr = bd.read_trace(window.path)
    [t] = bd.timelines(tr)
    [mark] = [e for e in tr["traceEvents"] if e.get("name") == "hpc_tools#comm all_reduce pg=horovod"]
    b = bd.buckets(t, bd.group_dims(tr, {}))
    assert t.step == 1 and b["comm.dp"] == pytest.approx(mark["dur"] / 1e6, abs=1e-9) and b["comm.dp"] > 0
    assert sum(b.values()) == pytest.approx((t.end - t.start) / 1e6)
