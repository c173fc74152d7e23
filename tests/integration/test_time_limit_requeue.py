"""Slurm's own time-limit signal (--signal=USR2@delay, rendered from cluster.signal_delay_s) reaches every rank, the
job records the preemption, requeues itself with `scontrol requeue`, and starts again with SLURM_RESTART_COUNT=1.
Without that signal the job runs into its limit and ends TIMEOUT: `logs -f` returns and `status` says why.

The jobs are comm_check (no model, seconds to start) with a 1-minute limit, paced (tests/helpers.py PACED): they
wait for Slurm rather than take the cores. Checkpoint/resume equality after such a
stop is tested with the Megatron and DeepSpeed trainers; here the signal path itself is real, end to end. The
time-out test runs against the fake Slurm too (fast tier), where the test plays what Slurm and the ranks record.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from hpc_tools.registry import RunFolder
from tests.helpers import PACED, run_cli, wait_for

ENDLESS = ["--set", "training.train_iters=100000000", "--set", "training.log_interval=100000"]
# slurmctld checks time limits every 30 s and sends the warning once the time left is within delay + 30 s: a 15 s
# delay lands it 15-45 s into the job, after the ranks installed their handler (45 s could land it at start, where
# USR2's default action kills a rank that is still importing).
REQUEUE = ["--set", "cluster.signal_delay_s=15"]
# --signal=USR2@0 (signal_delay_s=0): Slurm sends no warning signal before the limit, so the ranks run into it.
TIME_OUT = ["--set", "cluster.signal_delay_s=0", "--set", "cluster.requeue=false"]


def record_restarts(run: RunFolder) -> set[int]:
    path = run.records_dir / "rank00000.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {json.loads(line)["restart"] for line in lines if line.strip().endswith("}")}


def submit(runs_dir: Path, *sets: str) -> tuple[dict, RunFolder, float]:
    """comm_check with a 1-minute limit on Slurm: (submit's answer, its run folder, when it was submitted)."""
    out = run_cli("submit", "recipes/comm_check.yaml", "--profile", "local", "--executor", "slurm", "--json",
                  "--runs-dir", str(runs_dir), "--set", "cluster.time_limit=1", *sets, *ENDLESS, env=PACED)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    return job, RunFolder(job["run_dir"]), time.monotonic()


@pytest.fixture(scope="module")
def limited_jobs(tmp_path_factory):
    """Both real jobs, submitted together so that their minute-long limits run out side by side."""
    from tests.helpers import need_slurm

    need_slurm(1)
    runs, jobs = tmp_path_factory.mktemp("time_limit"), {}
    try:
        jobs["requeue"] = submit(runs / "requeue", *REQUEUE)
        jobs["timeout"] = submit(runs / "timeout", *TIME_OUT)
        yield jobs
    finally:
        for job, _, _ in jobs.values():
            subprocess.run(["scancel", job["job_id"]], timeout=30)


def test_time_limit_signal_requeues_the_job(slurm, limited_jobs):
    job, run, _ = limited_jobs["requeue"]
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            manifest = run.manifest()
            restarted = [e for e in manifest["events"] if e["event"] == "started" and e.get("restart_count") == 1]
            if restarted and 1 in record_restarts(run):
                break
            time.sleep(1)
        else:
            raise AssertionError(f"no restart within 240 s; events: {[e['event'] for e in run.manifest()['events']]}")
    finally:
        subprocess.run(["scancel", job["job_id"]], timeout=30)  # the other job keeps running into its limit
    events = [e["event"] for e in manifest["events"]]
    assert "preempted" in events and events.index("preempted") < len(events) - 1
    preempted = next(e for e in manifest["events"] if e["event"] == "preempted")
    assert preempted["state"] == "REQUEUED"
    # the requeued job appended to the same record file: every life's records, in order of lives (an endless job on a
    # loaded machine may already be in its third life, requeued again at its limit, when it is cancelled)
    lives = record_restarts(run)
    assert {0, 1} <= lives and lives == set(range(max(lives) + 1)), lives


def test_logs_follow_returns_when_the_job_times_out(slurm_cluster, runs_dir, request):
    """Also the fake side: the run-state verdict in milliseconds, where the real side waits out Slurm's limit."""
    real = slurm_cluster.kind == "real"
    if real:
        job, run, submitted = request.getfixturevalue("limited_jobs")["timeout"]
    else:  # what the ranks (SIGTERM at the limit) and then Slurm record
        job, run, submitted = submit(runs_dir, *TIME_OUT)
        run.update(event="started", state="RUNNING")
        run.update(event="preempted", state="PREEMPTED", last_step=7)
        slurm_cluster.settle(job["job_id"], "TIMEOUT", exit_code="0:0", elapsed="00:01:04", nodelist="n1")
    try:
        # Slurm enforces the limit on its 30 s check, then KillWait: the job ends 60-100 s after it starts.
        follow = run_cli("logs", run.run_id, "-f", "--runs-dir", str(run.path.parent), timeout=240)
        assert follow.returncode == 0, follow.stderr
        if real:
            assert "rendezvous ok: 2 ranks" in follow.stdout
            assert time.monotonic() - submitted >= 55, "logs -f returned before the time limit"
        status = wait_for(lambda: (s := json.loads(run_cli("status", run.run_id, "--json", "--runs-dir",
                                                            str(run.path.parent)).stdout))["slurm_state"] == "TIMEOUT"
                          and s, timeout_s=60, what="sacct to report TIMEOUT")
    finally:
        subprocess.run(["scancel", job["job_id"]], timeout=30)
    # The ranks' own report of the SIGTERM (PREEMPTED) gives way to Slurm's verdict.
    assert status["state"] == "TIMEOUT" and status["status"] == "timeout", status
    assert status["reason"].startswith("Slurm TIMEOUT after 00:01:"), status["reason"]
