"""``health.json`` across starts (hpc_tools/runtime/health_verdict.py): a node the checks of one start named, and
that the restart left out, stays in the file's ``named_all`` (and so in the status line) after the next start's
checks rewrite it; the next start's own checks and named nodes replace the earlier start's."""

from __future__ import annotations

from hpc_tools.runtime import health_verdict as hv
from hpc_tools.runtime.preflight import leave_out
from tests.unit.test_preflight_leave_out import rows


def check(number: int, step: int) -> dict:
    return {"check": number, "step": step, "time": 1000.0 + number, "seconds": 0.2, "nodes": {}}


def test_a_node_named_in_one_start_stays_in_health_json_after_the_next_starts_checks(tmp_path):
    first = hv.Record(start=0, interval_min=0.05, started=1000.0)
    for i, step in enumerate((5, 31, 33), start=1):
        first.add(check(i, step))
    [slow] = [r for r in rows(["n1", "n2"], "n2") if r.node == "n2"]
    first.name("n2", slow, first.checks[-1], "left out: " + leave_out.FEWER)
    first.write(tmp_path, 1100.0)
    assert [e["node"] for e in hv.read_report(tmp_path)["named_all"]] == ["n2"]
    second = hv.Record(start=1, interval_min=0.05, started=1200.0)  # n1 alone: one check, nothing named
    second.add(check(1, 37))
    for _ in range(2):  # every check of the start rewrites the file: the earlier entry is kept once
        second.write(tmp_path, 1210.0)
    data = hv.read_report(tmp_path)
    assert (data["start"], data["checks"], data["named"]) == (1, 1, [])
    [kept] = data["named_all"]
    assert (kept["node"], kept["start"], kept["check"], kept["step"]) == ("n2", 0, 3, 33), kept
    assert "named n2 at step 33 (check 3): GEMM" in hv.summary_line(data), hv.summary_line(data)
    third = hv.Record(start=1, interval_min=0.05, started=1200.0)  # a start that names a node again replaces its own
    third.add(check(2, 40))
    third.name("n2", slow, third.checks[-1], "nothing can replace it: training goes on")
    third.write(tmp_path, 1220.0)
    assert [(e["node"], e["start"]) for e in hv.read_report(tmp_path)["named_all"]] == [("n2", 0), ("n2", 1)]
