"""Health while training on real ranks (gloo, torch), without a Slurm cluster: three processes of ``python -m
hpc_tools.runtime.rank`` given the environment an srun rank step has (a node name each; nodes are compared with their
median from three on), training comm_check with a health check every 0.6 s (the recipe has one node, so that
preflight, ``auto``, is skipped: the checks while training also run on a job of one node). After two healthy checks
rank 1's process is put in a 0.2-CPU cgroup quota (cgroup v1 ``cpu``, as ``testing/slurm_faults.slow_node`` slows a
test-cluster node; all three ranks first get the highest CPU weight, so that the machine's other work does not
decide their speed); the checks name node2 within three checks, rank 0 records it (``health.json``, the manifest's
``health``, an event) and, with the restart controller's hints saying a spare is there, writes preflight's leave-out
marker (source ``health``) and every rank ends the step with preflight's exit code, which the controller acts on as
after preflight (its side: tests/unit/test_health.py and tests/unit/test_preflight_leave_out.py). One run for every
assertion."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_tools.recipe.load import dump_resolved, load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runtime import health_verdict
from hpc_tools.runtime.preflight import leave_out
from profiling.records import events_path
from tests.helpers import REPO
from tests.integration.test_preflight_leave_out_ranks import free_port

pytestmark = [pytest.mark.slow]
NODES = 3
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
HEALTHY_CHECKS = 2


def cpu_group(name: str, pids: list[int], cpu_share: float | None = None, period_us: int = 5000) -> Path:
    """``pids`` (all their threads) in a cgroup v1 ``cpu`` group of the highest weight (``cpu.shares``), so that the
    other work of a loaded test machine does not decide the ranks' speed, and with ``cpu_share`` of one CPU as its
    quota when given; the 5 ms period (the least quota the kernel takes is 1 ms) keeps each GEMM of the check (about
    10 ms) over the quota's burst."""
    group = CPU_ROOT / name
    group.mkdir(exist_ok=True)
    (group / "cpu.shares").write_text("262144")
    (group / "cpu.cfs_quota_us").write_text("-1")
    if cpu_share is not None:
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(int(period_us * cpu_share)))
    for pid in pids:
        (group / "cgroup.procs").write_text(str(pid))
    return group


def remove_group(group: Path) -> None:
    if not group.is_dir():
        return
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (CPU_ROOT / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    group.rmdir()


def cgroup_v1_cpu() -> bool:
    return os.geteuid() == 0 and (CPU_ROOT / "cpu.cfs_quota_us").is_file()


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory):
    """The run, the ranks' outcomes and the number of checks done when the quota was set."""
    if not cgroup_v1_cpu():
        pytest.skip("needs root and cgroup v1's cpu controller (cpu.cfs_quota_us) to slow a rank")
    tmp = tmp_path_factory.mktemp("health")
    recipe = load_recipe(REPO / "recipes" / "comm_check.yaml", profile="local",
                         overrides=["cluster.nodes=1", f"cluster.gpus_per_node={NODES}", "training.train_iters=100000",
                                    "training.log_interval=100000", "profiling.health_interval_min=0.01",
                                    "profiling.communication=false",
                                    "profiling.trace_sample_interval=0"])
    run = RunFolder.create(tmp, "r", dump_resolved(recipe), "", {"executor": "sbatch", "state": "STARTING",
                                                                  "world_size": NODES, "job_id": "78"})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPC_TOOLS_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_RANK", "MASTER_"))}
    env.update(PYTHONPATH=str(REPO), SLURM_JOB_ID="78", SLURM_NTASKS=str(NODES), SLURM_JOB_NUM_NODES=str(NODES),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo",
               **{leave_out.SPARES_ENV: str(NODES)})
    logs = [open(tmp / f"rank{r}.out", "w+") for r in range(NODES)]
    procs = [subprocess.Popen([sys.executable, "-m", "hpc_tools.runtime.rank", "--run-dir", str(run.path)],
                              env={**env, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r), "SLURM_LOCALID": "0",
                                   "SLURMD_NODENAME": f"node{r + 1}"}, cwd=REPO, stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(NODES)]
    groups, at_quota = [], None
    try:
        groups.append(cpu_group(f"hpc_tools_health_test_{os.getpid()}", [p.pid for p in procs]))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            report = health_verdict.read_report(run.path) or {}
            if report.get("checks", 0) >= HEALTHY_CHECKS:
                at_quota = report
                groups.append(cpu_group(f"hpc_tools_health_test_{os.getpid()}_slow", [procs[1].pid], 0.2))
                break
            time.sleep(0.1)
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for group in groups:
            remove_group(group)
    out = []
    for f in logs:
        f.seek(0)
        out.append(f.read())
        f.close()
    return run, [p.returncode for p in procs], "\n".join(out), at_quota


def test_a_rank_slowed_mid_run_is_named_within_three_checks_and_left_out(slowed_run):
    run, codes, logs, at_quota = slowed_run
    assert at_quota is not None, f"no {HEALTHY_CHECKS} checks before the ranks ended: {codes}\n{logs[-4000:]}"
    assert at_quota["named"] == [], at_quota  # the healthy checks named no node
    assert codes == [leave_out.EXIT_CODE] * NODES, logs[-4000:]
    report = health_verdict.read_report(run.path)
    named = {e["node"]: e for e in report["named"]}
    assert "node2" in named, report
    assert named["node2"]["check"] <= at_quota["checks"] + 3, (at_quota["checks"], named)
    assert named["node2"]["reasons"][0].startswith("GEMM "), named
    assert named["node2"]["action"] == f"left out: {leave_out.SPARE}"
    marker = leave_out.read(run.path, 0)
    assert marker is not None and marker["source"] == "health" and "node2" in marker["nodes"], marker
    manifest = run.manifest()
    events = [e["event"] for e in manifest["events"]]
    assert "health named" in events and "health leave-out" in events and "completed" not in events, events
    assert "node2" in {e["node"] for e in manifest["health"]["named_all"]}
    assert "Traceback" not in logs, logs[-4000:]
    check, step = named["node2"]["check"], named["node2"]["step"]
    for r in range(NODES):  # every rank ends the step in the same words, after the checkpoint of the same step
        assert re.search(rf"\[rank {r}\] WARNING hpc_tools: health check {check} at step {step} .*node2 out of the "
                         rf"run: {leave_out.SPARE} \(after the checkpoint of step {step}\)", logs), logs[-4000:]
    # every check's time is recorded (rank 0's events) and counted in the record's share of the start
    lines = events_path(run.records_dir, 0).read_text().splitlines()
    checks = [json.loads(x) for x in lines if '"health_check"' in x]
    assert len(checks) == report["checks"] and all(c["seconds"] > 0 for c in checks)
    assert 0 < report["share"] < 1
