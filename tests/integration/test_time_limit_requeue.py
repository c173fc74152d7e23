"""Slurm's own time-limit signal (--signal=USR2@delay, rendered from cluster.signal_delay_s) reaches every rank, the
job records the preemption, requeues itself with `scontrol requeue`, and starts again with SLURM_RESTART_COUNT=1.

The job is comm_check (no model, seconds to start) with a 1-minute limit. Checkpoint/resume equality after such a
stop is tested with the Megatron and DeepSpeed trainers; here the signal path itself is real, end to end.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from hpc_tools.registry import RunFolder
from tests.conftest import run_cli

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def record_restarts(run: RunFolder) -> set[int]:
    path = run.records_dir / "rank00000.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {json.loads(line)["restart"] for line in lines if line.strip().endswith("}")}


def test_time_limit_signal_requeues_the_job(slurm, runs_dir):
    out = run_cli("submit", "recipes/comm_check.yaml", "--profile", "local", "--executor", "slurm", "--json",
                  "--runs-dir", str(runs_dir), "--set", "cluster.time_limit=1", "--set", "cluster.signal_delay_s=45",
                  "--set", "training.train_iters=100000000", "--set", "training.log_interval=100000")
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    run = RunFolder(job["run_dir"])
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
        subprocess.run(["scancel", job["job_id"]], timeout=30)
    events = [e["event"] for e in manifest["events"]]
    assert "preempted" in events and events.index("preempted") < len(events) - 1
    preempted = next(e for e in manifest["events"] if e["event"] == "preempted")
    assert preempted["state"] == "REQUEUED"
    assert record_restarts(run) == {0, 1}  # the requeued job appended to the same record file
