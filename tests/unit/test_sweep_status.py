"""Cell classification (hpc_tools.runstate.classify, through the sweep's classify_run) from sacct states as sacct
prints them, run manifests, HANG markers and logs."""

from __future__ import annotations

import json

import pytest

from hpc_tools.recipe.load import dump_resolved
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import SlurmJob, classify, parse_sacct
from hpc_tools.sweep.runner import classify_run
from hpc_tools.testing.synthetic import synthetic_recipe

# `sacct -X -n -P -o JobID,State,ExitCode,Elapsed,NodeList` lines as Slurm 22.05 prints them.
SACCT_OUTPUT = """\
101|COMPLETED|0:0|00:00:12|n1
102|FAILED|1:0|00:00:12|n1
103|OUT_OF_MEMORY|0:125|00:00:12|n1
104|TIMEOUT|0:0|00:01:09|n1
105|NODE_FAIL|0:0|00:00:12|n[1-2]
106|CANCELLED by 0|0:0|00:00:12|n1
107|RUNNING|0:0|00:00:12|n1
108|PENDING|0:0|00:00:00|None assigned
109|FAILED|86:0|00:00:12|n1
110|REQUEUED|0:0|00:00:00|None assigned
111_0|COMPLETED|0:0|00:00:12|n1
111_[1-3,5]|PENDING|0:0|00:00:00|None assigned
112_[0-7%2]|PENDING|0:0|00:00:00|None assigned
113|PREEMPTED|0:15|00:00:12|n2
"""


def job(state: str, exit_code: str = "0:0") -> SlurmJob:
    return SlurmJob("1", state, exit_code, "00:00:10", "n1")


def test_parse_sacct_expands_pending_array_tasks():
    states = parse_sacct(SACCT_OUTPUT)
    assert (states["111_0"].state, states["111_0"].exit_code) == ("COMPLETED", "0:0")
    assert {k for k in states if k.startswith("111_")} == {"111_0", "111_1", "111_2", "111_3", "111_5"}
    assert states["112_7"].state == "PENDING" and states["112_7"].job_id == "112_7"
    assert states["106"].slurm_state == "CANCELLED" and states["105"].nodelist == "n[1-2]"


@pytest.mark.parametrize("job,expected", [
    ("101", "completed"), ("102", "failed"), ("103", "out_of_memory"), ("104", "timeout"), ("105", "node_failure"),
    ("106", "cancelled"), ("107", "running"), ("108", "pending"), ("109", "hang"), ("110", "pending"),
    ("111_2", "pending"), ("113", "preempted")])
def test_sacct_states(job, expected):
    verdict = classify(None, parse_sacct(SACCT_OUTPUT)[job])
    assert verdict.status == expected and verdict.reason.startswith("Slurm ")


def make_run(tmp_path, state: str, **manifest) -> RunFolder:
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = RunFolder.create(tmp_path, f"r-{state.lower()}-{len(list(tmp_path.iterdir()))}",
                           dump_resolved(synthetic_recipe()), "", {"state": state, **manifest})
    return run


@pytest.mark.parametrize("state,expected", [
    ("CREATED", "pending"), ("PENDING", "pending"), ("RUNNING", "running"), ("REQUEUED", "pending"),
    ("COMPLETED", "completed"), ("FAILED", "failed"), ("CANCELLED", "cancelled")])
def test_manifest_states(tmp_path, state, expected):
    assert classify_run(make_run(tmp_path, state), None, None, "slurm").status == expected


def test_terminal_sacct_beats_a_stale_running_manifest(tmp_path):
    run = make_run(tmp_path, "RUNNING", job_id="104")  # the rank was killed at the time limit: no manifest update
    assert classify_run(run, job("TIMEOUT", "0:0"), None, "slurm").status == "timeout"
    assert classify_run(run, job("RUNNING", "0:0"), None, "slurm").status == "running"


def test_hang_marker_explains_a_failure(tmp_path):
    run = make_run(tmp_path, "FAILED")
    (run.path / "HANG-rank00003.txt").write_text("no step completed for 1800 s\n")
    assert classify_run(run, job("FAILED", "86:0"), None, "slurm").status == "hang"
    verdict = classify_run(run, None, None, "local")
    assert verdict.status == "hang" and verdict.reason == "HANG-rank00003.txt: no step completed for 1800 s"


@pytest.mark.parametrize("log,expected", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out_of_memory"),
    ("slurmstepd: error: *** JOB 12 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO TIME LIMIT ***", "timeout"),
    ("slurmstepd: error: *** JOB 12 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO NODE FAILURE ***", "node_failure"),
    ("RuntimeError: something else", "failed")])
def test_logs_explain_a_plain_failure(tmp_path, log, expected):
    run = make_run(tmp_path, "FAILED")
    (run.logs_dir / "rank00001.out").write_text("step 3 ...\n" + log + "\n")
    verdict = classify_run(run, job("FAILED", "1:0"), None, "slurm")
    assert verdict.status == expected
    slurm = "Slurm FAILED, exit code 1:0 after 00:00:10"
    assert verdict.reason == (f"rank00001.out: {log}" if expected != "failed" else slurm)


def test_submitit_logs_from_the_manifest_glob(tmp_path):
    logs = tmp_path / "submitit"
    logs.mkdir()
    (logs / "77_0_log.err").write_text("srun: error: n2: task 1: Out Of Memory\n")
    run = make_run(tmp_path, "RUNNING", log_glob=str(logs / "77_*_log.*"))
    assert classify_run(run, job("OUT_OF_MEMORY", "0:125"), None, "slurm").status == "out_of_memory"
    assert classify_run(run, job("FAILED", "1:0"), None, "slurm").status == "out_of_memory"


def test_local_run_left_running_by_a_dead_sweep_is_failed(tmp_path):
    run = make_run(tmp_path, "RUNNING")
    dead_pid = 2 ** 22 + 12345  # above pid_max on Linux by default: never alive
    assert classify_run(run, None, dead_pid, "local").status == "failed"
    import os

    assert classify_run(run, None, os.getpid(), "local").status == "running"


def test_missing_run_folder_is_pending_unless_sacct_knows(tmp_path):
    assert classify_run(None, None, None).status == "pending"
    assert classify_run(None, job("CANCELLED by 0", "0:0"), None, "slurm").status == "cancelled"


def test_status_cli_reads_a_sweep_folder(tmp_path, cli):
    from hpc_tools.sweep.folder import SweepFolder

    run_ok, run_bad = make_run(tmp_path / "x", "COMPLETED"), make_run(tmp_path / "x", "FAILED")
    cells = [{"id": f"c00{i}-r0", "cell": i, "repeat": 0, "label": f"n={i}", "params": {}, "overrides": [],
              "run_dir": str(r.path), "run_id": r.run_id, "job_id": None, "status": "pending", "attempts": []}
             for i, r in enumerate((run_ok, run_bad))]
    folder = SweepFolder.create(tmp_path / "runs", "demo", {"executor": "local", "cells": cells, "invalid": []})
    out = cli("sweep", "status", str(folder.path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["summary"] == {"completed": 1, "failed": 1}
    dry = cli("sweep", "rerun", folder.sweep_id, "--failed", "--dry-run", "--runs-dir", str(tmp_path / "runs"),
              "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["rerun"] == ["c001-r0"]
    bad = cli("sweep", "rerun", str(folder.path))
    assert bad.returncode == 2 and "needs --failed" in bad.stderr and "Traceback" not in bad.stderr
