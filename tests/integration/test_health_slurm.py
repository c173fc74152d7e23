"""Health while training on the real 2-node test cluster (issue 48 item 2's done-when): a node slowed mid-run is named
within three checks and the next start, inside the same Slurm job, leaves it out.

One job: recipes/gpt_3d.yaml's local profile (Megatron-core TP2 x PP2 with the plain optimizer, whose checkpoint
reshards into the one-node layout) on 2 nodes x 2 ranks, `cluster.restarts: 1`, `cluster.min_nodes: 1` (no spare:
an elastic job goes on without the node), preflight left `auto`, and a health check every 3 s
(`profiling.health_interval_min: 0.05`). Every rank process gets the highest CPU weight (cgroup v1 ``cpu.shares``)
once its heartbeat names its pid, so that the machine's other work (the other xdist worker's tests) does not decide
the ranks' speed; once rank 0 has done step QUOTA_AT, the ranks the heartbeats place on n2 are put in a 0.2-CPU quota
(a 5 ms period so that each GEMM of the check outlasts the quota's burst; ``test_health_while_training.cpu_group``).
The checks name n2 within three checks of the quota (polled during the run in ``health.json``; then the manifest
and `status`), rank 0 writes preflight's leave-out marker (source ``health``), the ranks save the step's checkpoint
and end the step, and the restart controller starts the next step on n1 alone (one restart entry: named by the
health check, decision "leave out"), which resumes from that checkpoint and completes the run: every step recorded,
the last start's ranks all on n1. Figures are printed with -s.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from hpc_tools.registry import RunFolder
from hpc_tools.runtime import health_verdict, heartbeat
from hpc_tools.runtime.preflight import leave_out
from tests.helpers import in_queue, loss_curve, need_slurm, run_cli
from tests.integration.test_health_while_training import cgroup_v1_cpu, cpu_group, remove_group

RECIPE = "recipes/gpt_3d.yaml"
QUOTA_AT, STEPS = 30, 45
SETS = ["--profile", "local", "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=2",
        "--set", "cluster.restarts=1", "--set", "cluster.min_nodes=1", "--set", f"training.train_iters={STEPS}",
        "--set", "backend.megatron.distributed_optimizer=false",  # its checkpoint reshards into the one-node layout
        "--set", "profiling.health_interval_min=0.05", "--set", 'cluster.setup.env.OMP_NUM_THREADS="1"',
        "--set", "cluster.time_limit=15"]
DEADLINE_S = 600

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.megatron, pytest.mark.slow]



def named_n2(run: RunFolder) -> dict | None:
    """n2's entry in ``health.json`` (any start's), or None."""
    report = health_verdict.read_report(run.path) or {}
    return next((e for e in report.get("named_all") or report.get("named") or [] if e["node"] == "n2"), None)


def join(group: Path, pid: int) -> None:
    with contextlib.suppress(OSError):  # a process that ended meanwhile
        (group / "cgroup.procs").write_text(str(pid))


def watch(run: RunFolder, job_id: str, groups: list[Path]) -> dict:
    """Until the job ends: every rank (of every start) at the highest CPU weight once its heartbeat names its pid;
    after rank 0's step QUOTA_AT, n2's ranks in the 0.2-CPU quota; n2's entry in ``health.json`` when it appears.
    What was seen: the step and the checks done at the quota, n2's entry, seconds from the quota to it."""
    tag = f"hpc_tools_health_slurm_{os.getpid()}"
    fast = cpu_group(f"{tag}_ranks", [])
    groups.append(fast)
    seen: dict = {}
    moved: set[int] = set()
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and in_queue(job_id):
        beats = heartbeat.read_all(run.path)  # each rank's newest beat, whichever start wrote it
        for b in beats.values():
            if b.pid not in moved:
                join(fast, b.pid)
                moved.add(b.pid)
        first = {r: b for r, b in beats.items() if b.restart == 0}
        if "step" not in seen and len(first) == 4 and first[0].step >= QUOTA_AT:
            seen.update(step=first[0].step, checks=(health_verdict.read_report(run.path) or {}).get("checks", 0),
                        time=time.time(), named_before=named_n2(run))
            groups.append(cpu_group(f"{tag}_n2", [b.pid for b in first.values() if b.node == "n2"], 0.2))
        if "step" in seen and "named" not in seen and named_n2(run):  # named during the run
            seen.update(named=named_n2(run), named_after_s=time.time() - seen["time"])
        time.sleep(0.3)
    return seen


@pytest.fixture(scope="module")
def slowed(tmp_path_factory) -> dict:
    need_slurm(2)
    if not cgroup_v1_cpu():
        pytest.skip("needs root and cgroup v1's cpu controller (cpu.cfs_quota_us) to slow a node's ranks")
    tmp = tmp_path_factory.mktemp("health_slurm")
    out = run_cli("submit", RECIPE, "--executor", "slurm", "--json", "--runs-dir", str(tmp / "runs"), *SETS,
                  timeout=120)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    run, job_id = RunFolder(job["run_dir"]), job["job_id"]
    groups: list[Path] = []
    try:
        seen = watch(run, job_id, groups)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        for group in reversed(groups):
            remove_group(group)
    sacct = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True,
                           timeout=30).stdout.split()
    return {"run": run, "job_id": job_id, "seen": seen, "sacct": sacct}


def test_the_slowed_node_is_named_within_three_checks_during_the_run(slowed):
    run, seen = slowed["run"], slowed["seen"]
    assert "step" in seen, (f"job {slowed['job_id']} ended before step {QUOTA_AT}", run.manifest().get("state"))
    assert seen["named_before"] is None, seen  # the healthy checks before the quota named nothing
    named = seen.get("named")
    assert named, f"n2 never named during the run; health.json: {health_verdict.read_report(run.path)}"
    assert named["start"] == 0 and named["step"] >= seen["step"], (named, seen)
    assert named["check"] <= seen["checks"] + 3, (named, seen)  # within three checks of the quota
    assert named["reasons"][0].startswith("GEMM ") and "the other node's" in named["reasons"][0], named
    assert named["action"] == f"left out: {leave_out.FEWER}", named
    m = run.manifest()
    assert named in m["health"]["named_all"], m["health"]  # the manifest keeps it across the restart...
    events = [e["event"] for e in m["events"]]
    assert {"health named", "health leave-out"} <= set(events), events
    status = run_cli("status", str(run.path))  # ...and status shows it, from the finished run
    assert status.returncode == 0, status.stderr
    assert f"named n2 at step {named['step']} (check {named['check']})" in status.stdout, status.stdout
    assert "error    " not in status.stdout and "status   completed" in status.stdout, status.stdout
    print(f"\njob {slowed['job_id']}: quota on n2's ranks after step {seen['step']} (check {seen['checks']} done); "
          f"named at step {named['step']} by check {named['check']}, {seen['named_after_s']:.0f} s after the quota")


def test_the_next_start_leaves_the_node_out_and_completes_on_n1(slowed):
    run = slowed["run"]
    m = run.manifest()
    assert m["state"] == "COMPLETED" and slowed["sacct"] == ["COMPLETED"], (m["state"], slowed["sacct"],
                                                                             m.get("reason"), m["events"][-5:])
    [entry] = m["restarts"]
    assert (entry["cause"], entry["named_by"], entry["kind"], entry["decision"]) == \
        ("preflight", "health", "in-job", "leave out"), entry
    assert entry["nodes_named"] == ["n2"] and entry["nodes"] == ["n1"] and entry["layout_nodes"] == 1, entry
    named = named_n2(run)
    assert named is not None and entry["from_iteration"] == named["step"], (entry, named)  # the step's own save
    last = heartbeat.read_all(run.path, entry["restart"])
    assert last and {b.node for b in last.values()} == {"n1"}, {r: b.node for r, b in last.items()}
    assert max(b.step for b in last.values()) == STEPS
    assert sorted(loss_curve(run.path)) == list(range(1, STEPS + 1))
    fewer = m["layouts"][-1]
    assert (fewer["nodes"], fewer["from_iteration"]) == (1, entry["from_iteration"]), m["layouts"]
