"""Health while training (issue 48 item 2; hpc_tools/runtime/health_verdict.py, runtime/health.py): when checks run,
which nodes a series of checks names, what the run folder, the manifest and ``status`` keep, and the restart
controller's side of a node the health check named (preflight's leave-out, told apart by ``named_by``). The rank side
on real ranks: tests/integration/test_health_while_training.py."""

from __future__ import annotations

import pytest

from hpc_tools.job import restarts
from hpc_tools.job.failure_class import INFRA
from hpc_tools.runtime import health_verdict as hv
from hpc_tools.runtime.preflight import leave_out
from hpc_tools.runtime.preflight.verdict import EXPECTED_FLOOR, RankResult, judge
from tests.unit.test_preflight_leave_out import PARTITION, REASON, rows
from tests.unit.test_restarts import exported, run_folder


@pytest.mark.parametrize("interval_s, rates, ahead", [
    (300.0, [0.1, 0.2], 1500),       # the slowest rank's rate decides: 300 s / 0.2 s
    (300.0, [0.2, 0.1], 1500),       # whatever the order
    (60.0, [0.0, None, float("nan")], 1),   # no rate measured: the next step
    (1.0, [5.0], 1),                 # steps longer than the interval: every step, never the same step again
])
def test_the_next_check_is_an_interval_ahead_at_the_slowest_ranks_rate(interval_s, rates, ahead):
    assert hv.next_step(40, interval_s, rates) == 40 + ahead


def test_the_first_check_follows_the_warm_up():
    assert hv.first_step(1, 2) == 3 and hv.first_step(41, 0) == 42 and hv.first_step(41, 5) == 46


def test_a_node_is_named_after_two_checks_in_a_row_and_once():
    t = hv.Tracker()
    assert t.add(1, ["n2"]) == []            # one check can fall in a moment other work took the host
    assert t.add(2, []) == []                # ... and the streak ends with a healthy check
    assert t.add(3, ["n2", "n3"]) == []
    assert t.add(4, ["n2"]) == ["n2"] and t.named == {"n2": 4}
    assert t.add(5, ["n2", "n3"]) == []      # n2 is not named twice; n3's streak was broken at check 4
    assert t.add(6, ["n3"]) == ["n3"] and t.named == {"n2": 4, "n3": 6}


def test_the_checks_judge_a_node_as_preflight_does():
    """A node at a fifth of its peers' GEMM is slow by preflight's own verdict; within the margin it is not."""
    figures = {"n1": 0.5, "n2": 0.1, "n3": 0.52, "n4": 0.48}
    slow = hv.slow_nodes(judge([RankResult(rank=i, node=n, gemm_tflops=g) for i, (n, g) in enumerate(figures.items())]))
    assert slow == ["n2"]
    healthy = {"n1": 0.5, "n2": 0.4, "n3": 0.52}
    assert hv.slow_nodes(judge([RankResult(rank=i, node=n, gemm_tflops=g)
                                for i, (n, g) in enumerate(healthy.items())])) == []


def test_the_all_reduce_is_a_problem_below_half_the_first_checks():
    assert hv.link_problem(1.0, 1.0, 1 << 20) is None
    assert hv.link_problem(EXPECTED_FLOOR * 1.0, 1.0, 1 << 20) is None
    line = hv.link_problem(0.3, 1.0, 1 << 20)
    assert line.startswith("all-reduce busbw over all ranks 0.3 GB/s at 1 MiB is 0.30x the first check's 1 GB/s")
    assert hv.link_problem(None, 1.0, 1) is None and hv.link_problem(0.1, None, 1) is None


def test_the_record_its_share_and_the_status_line(tmp_path):
    rec = hv.Record(start=1, interval_min=5.0, started=1000.0)
    for i, step in enumerate((3, 300, 600), start=1):
        rec.add({"check": i, "step": step, "time": 1000.0 + 100 * i, "seconds": 0.25, "nodes": {}})
    [row] = [r for r in rows(["n1", "n2", "n3"], "n2") if r.node == "n2"]
    rec.name("n2", row, rec.checks[-1], "left out: " + leave_out.SPARE)
    assert rec.share(1000.0 + 75.0) == pytest.approx(0.75 / 75.0)
    rec.write(tmp_path, 1075.0)
    data = hv.read_report(tmp_path)
    assert (data["checks"], data["seconds"], data["last_step"], data["confirm"]) == (3, 0.75, 600, hv.CONFIRM)
    assert data["named"] == [{"node": "n2", "start": 1, "step": 600, "check": 3, "time": 1300.0, "reasons": [REASON],
                              "gemm_tflops": 0.1, "verdict": "slow", "action": "left out: " + leave_out.SPARE}]
    line = hv.summary_line(data)
    assert line.startswith("3 check(s) every 5 min, 0.75 s (1.00 % of the start); named n2 at step 600 (check 3, "
                           f"start 1): {REASON}; left out: ")
    assert hv.summary_line({**data, "named": [], "named_all": []}).endswith("; no node named")
    assert hv.summary_line(None) is None and hv.summary_line({"checks": 0}) is None


def test_the_manifest_keeps_the_nodes_named_in_earlier_starts():
    before = [{"node": "n2", "start": 0}, {"node": "n5", "start": 1}]
    now = [{"node": "n3", "start": 1}]
    assert hv.merged_named(before, now) == [{"node": "n2", "start": 0}, {"node": "n3", "start": 1}]
    assert hv.merged_named(None, now) == now


@pytest.fixture()
def _partition(monkeypatch):
    monkeypatch.setattr(restarts.nodes, "partition_nodes", lambda env: list(PARTITION))


def test_the_controller_leaves_a_node_the_health_check_named_out_as_after_preflight(tmp_path, monkeypatch, _partition):
    """The marker the rank side writes mid-run (``source: health``) takes the controller's leave-out path: a spare
    takes the node's place, the record says who named it; its cause stays ``preflight`` so that the restart budget
    and the requeue's exclusions count it alike."""
    allocation, step, named = ["n1", "n2", "n3", "n4"], ["n1", "n2", "n3"], "n2"
    policy = restarts.Policy(nodes=3, budget=1, requeue=False)
    run = run_folder(tmp_path, "cluster.restarts=1")
    monkeypatch.setattr(restarts.nodes, "allocation_nodes", lambda job, env: list(allocation))
    said = []
    monkeypatch.setattr(restarts.action, "say", lambda line, restart=False: said.append(line))
    hints = restarts.preflight_hints(allocation, step, [], policy, run.manifest(), "77")
    env = {"SLURM_JOB_ID": "77", "HPC_TOOLS_NODELIST": ",".join(step), "HPC_TOOLS_EXCLUDED": "",
           **{k: str(v) for k, v in hints.items()}}
    assert leave_out.replacement([named], env) == leave_out.SPARE  # what the rank side decides from
    about = {named: {"verdict": "slow", "reasons": [REASON], "gemm_tflops": 0.1, "step": 600, "check": 3}}
    leave_out.write(run.path, 0, [named], "auto", f"health check 3 at step 600: node {named} slow: {REASON}",
                    leave_out.SPARE, about, source="health")
    line = restarts.next_step(run.path, leave_out.EXIT_CODE, env, prober=lambda n: True, wait_s=0.0, policy=policy)
    [entry] = run.manifest()["restarts"]
    assert (entry["cause"], entry["named_by"], entry["class"], entry["nodes_named"]) == ("preflight", "health",
                                                                                         INFRA, [named])
    assert entry["reason"] == f"the health check named {named} slow ({REASON})"
    assert (entry["kind"], entry["decision"]) == ("in-job", "leave out")
    assert exported(line)["HPC_TOOLS_NODELIST"].split(",") == ["n1", "n3", "n4"]
    assert said == [f"1 of 1 in this run (the health check named {named} slow ({REASON}); infrastructure): {named} "
                    "left out, a new step on n1,n3,n4"]


def test_a_preflight_marker_is_still_preflights(tmp_path):
    leave_out.write(tmp_path, 2, ["n1"], "auto", "line", leave_out.SPARE, {})
    assert leave_out.read(tmp_path, 2)["source"] == "preflight"
    assert restarts.named_nodes.namer(leave_out.read(tmp_path, 2)) == "preflight"
    assert restarts.named_nodes.namer({"source": "health"}) == "the health check"


def test_status_and_the_report_show_the_checks():
    from hpc_tools.analysis.metrics import _health_checks
    from hpc_tools.cli.status import _checks_line

    health = {"checks": 4, "interval_min": 5.0, "seconds": 1.2, "share": 0.001, "named": [],
              "named_all": [{"node": "n2", "start": 0, "step": 90, "check": 2, "reasons": [REASON],
                             "action": "nothing can replace it: training goes on"}]}
    [line] = _checks_line({"health": health})
    assert line == (f"health   4 check(s) every 5 min, 1.2 s (0.10 % of the start); named n2 at step 90 (check 2): "
                    f"{REASON}; nothing can replace it: training goes on")
    assert _health_checks({"health": health}) == line[len("health   "):]
    assert _checks_line({}) == [] and _health_checks({}) == ""
