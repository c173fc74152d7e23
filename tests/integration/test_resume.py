"""`python -m hpc_tools resume RUN` on real runs: a local DeepSpeed run whose rank 1 is killed (SIGKILL) mid-run ends
FAILED; `resume` continues it in its own folder from its newest checkpoint to the losses of an uninterrupted run,
appending records with restart 1, and `analyze` counts every step once. On the Slurm test cluster a job cancelled
after a checkpoint (`scancel`) is resumed in the same folder under a new job id and completes.

The job is recipes/gpt_zero.yaml's local profile (a tiny LLaMA under ZeRO-2 on 2 CPU ranks), cut to a few steps with a
checkpoint every 3. Every rank runs one OpenMP thread (the local executor's default, set explicitly on Slurm), so the
losses of the resumed steps must be bit-identical to the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_tools.registry import RunFolder
from hpc_tools.runstate import READER
from tests.helpers import REPO, loss_curve, run_cli, step_records, wait_for

RECIPE = str(REPO / "recipes" / "gpt_zero.yaml")
ITERS, INTERVAL, KILL_AFTER = 15, 3, 4
SETS = ["--set", f"training.train_iters={ITERS}", "--set", f"checkpoint.interval_iters={INTERVAL}",
        "--set", "checkpoint.keep_last=4"]

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


def only_run(runs_dir: Path) -> RunFolder:
    runs = [p for p in runs_dir.iterdir() if (p / "manifest.json").is_file()] if runs_dir.is_dir() else []
    return RunFolder(runs[0]) if len(runs) == 1 else None


def rank0_steps(run: RunFolder) -> int:
    recs = step_records(run.path).get(0, [])
    return recs[-1]["step"] if recs else 0


def kept_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of its newest record (the last one in file order), as the analysis keeps it."""
    return loss_curve(run_dir)


def test_resume_after_a_killed_rank_gives_the_uninterrupted_losses(tmp_path):
    ref = run_cli("submit", RECIPE, "--executor", "local", "--json", "--runs-dir", str(tmp_path / "ref"), *SETS)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = kept_losses(Path(json.loads(ref.stdout)["run_dir"]))
    assert sorted(reference) == list(range(1, ITERS + 1))

    runs_dir = tmp_path / "runs"
    t_submit = time.time()
    submit = subprocess.Popen([sys.executable, "-m", "hpc_tools", "submit", RECIPE, "--executor", "local", "--json",
                               "--runs-dir", str(runs_dir), *SETS], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: only_run(runs_dir), timeout_s=120, what="the run folder", poll_s=0.05)
        def killable() -> bool:
            if submit.poll() is not None:  # ended before the kill: say how, not "timed out" 300 s later
                raise AssertionError(f"the run ended before step {KILL_AFTER} (exit {submit.returncode}): "
                                     f"{submit.stderr.read()[-3000:]}")
            return rank0_steps(run) >= KILL_AFTER and bool(run.manifest().get("pids"))

        wait_for(killable, timeout_s=300, what=f"step {KILL_AFTER}", poll_s=0.02)
        victim = run.manifest()["pids"][1]
        os.kill(victim, signal.SIGKILL)
        killed_at = rank0_steps(run)
        out, err = submit.communicate(timeout=120)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode != 0 and killed_at < ITERS, (killed_at, err[-2000:])
    failed = run.manifest()
    assert failed["state"] == "FAILED", failed["events"][-3:]
    assert failed["failed_ranks"] == [1] and "rank 1" in failed["reason"], failed  # the killed rank, not rank 0

    t0 = time.time()
    resumed = run_cli("resume", run.run_id, "--json", "--runs-dir", str(runs_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads(resumed.stdout)
    assert (result["state"], result["restart"], result["run_dir"]) == ("COMPLETED", 1, str(run.path))
    from_step = result["from_step"]
    assert INTERVAL <= from_step <= killed_at and from_step % INTERVAL == 0

    manifest = run.manifest()
    assert manifest["state"] == "COMPLETED" and manifest["restart_count"] == 1
    assert manifest["resumes"][-1]["previous_state"] == "FAILED"
    assert [e["event"] for e in manifest["events"]].count("resumed") == 1
    for rank, recs in step_records(run.path).items():
        first = [r["step"] for r in recs if r["restart"] == 0]
        again = [r["step"] for r in recs if r["restart"] == 1]
        assert first[:from_step] == list(range(1, from_step + 1)), f"rank {rank}"
        assert again == list(range(from_step + 1, ITERS + 1)), f"rank {rank}: appended records of restart 1"
    losses = kept_losses(run.path)
    assert losses == reference, {s: (losses.get(s), reference[s]) for s in reference if losses.get(s) != reference[s]}
    recomputed = {r["step"]: r["loss"] for r in step_records(run.path)[0] if r["restart"] == 1}
    assert all(recomputed[s] == reference[s] for s in recomputed)

    analysis = run_cli("analyze", str(run.path), "--json", "--warmup", "0")
    assert analysis.returncode == 0, analysis.stderr[-2000:]
    row = json.loads(analysis.stdout)["runs"][0]
    assert row["steps_measured"] == ITERS, row  # a step that ran twice counts once
    # Goodput: two lives; the steps the first life ran past its last checkpoint are lost work, recomputed by the
    # second; each life spent time starting up, the second also loading the checkpoint.
    lost = [r for r in step_records(run.path)[0] if r["restart"] == 0 and r["step"] > from_step]
    goodput = json.loads(analysis.stdout)["goodput"][0]
    assert goodput["lives"] == 2 and goodput["recomputed_steps"] == len(lost), goodput
    assert goodput["lost_work_s"] == pytest.approx(sum(r["step_time_s"] for r in lost)), goodput
    assert goodput["startup_s"] > 0 and goodput["checkpoint_load_s"] > 0 and goodput["checkpoint_save_s"] > 0, goodput
    assert 0 < goodput["goodput"] < 1, goodput

    first_step = {restart: min(r["time"] for r in step_records(run.path)[0] if r["restart"] == restart)
                  for restart in (0, 1)}
    print(f"\nresume: killed after step {killed_at}, resumed from step {from_step}; first resumed step "
          f"{first_step[1] - t0:.1f} s after `resume` started (the first start: {first_step[0] - t_submit:.1f} s "
          f"after `submit`); {len(recomputed)} resumed losses equal the uninterrupted run's "
          f"({killed_at - from_step} of them recomputed)")


@pytest.mark.slurm
def test_resume_a_cancelled_slurm_job_in_its_own_folder(slurm, runs_dir):
    out = run_cli("submit", RECIPE, "--profile", "local", "--executor", "slurm", "--json", "--runs-dir",
                  str(runs_dir), *SETS, "--set", "training.train_iters=40", "--set",
                  'cluster.setup.env.OMP_NUM_THREADS="1"', "--set", "cluster.hang_timeout_min=5")
    assert out.returncode == 0, out.stderr
    t_submit = time.time()
    first = json.loads(out.stdout)
    run = RunFolder(first["run_dir"])
    jobs = [first["job_id"]]
    try:
        # A shared cluster may queue the job for a while before it starts.
        wait_for(lambda: READER.job(first["job_id"]) and READER.job(first["job_id"]).slurm_state != "PENDING",
                 timeout_s=600, what="the job to start", poll_s=2)
        wait_for(lambda: rank0_steps(run) > INTERVAL, timeout_s=300, what="a checkpoint", poll_s=0.2)
        subprocess.run(["scancel", first["job_id"]], timeout=30, check=True)
        wait_for(lambda: (j := READER.job(first["job_id"])) and j.terminal, timeout_s=120, what="the job to end")
        # The new job must avoid the node the first one ran on (as when that node is the suspect), where there is
        # another node to go to.
        ran_on = run.manifest().get("nodelist") or ""
        avoid = ["--exclude", ran_on] if slurm > 1 and ran_on and "," not in ran_on and "[" not in ran_on else []
        t0 = time.time()
        resumed = run_cli("resume", first["job_id"], "--json", "--wait", "--runs-dir", str(runs_dir), *avoid,
                          timeout=900)
        result = json.loads(resumed.stdout) if resumed.stdout.strip() else {}
        jobs.append(result.get("job_id"))
        assert resumed.returncode == 0, (result, resumed.stderr[-3000:], run.manifest().get("events", [])[-8:],
                                         subprocess.run(["sacct", "-n", "-P", "-o", "JobID,State,ExitCode,Reason,"
                                                         "NodeList", "-j", ",".join(filter(None, jobs))],
                                                        capture_output=True, text=True, timeout=30).stdout)
    finally:
        for job in filter(None, jobs):
            subprocess.run(["scancel", job], timeout=30)
    manifest = run.manifest()
    assert result["job_id"] != first["job_id"] and result["run_dir"] == str(run.path)
    assert (manifest["state"], manifest["job_id"]) == ("COMPLETED", result["job_id"]), manifest["events"][-4:]
    if avoid:
        assert manifest["nodelist"] != ran_on and manifest["resumes"][-1]["exclude"] == ran_on
    event = next(e for e in manifest["events"] if e["event"] == "resumed")
    assert (event["previous_job_id"], event["job_id"]) == (first["job_id"], result["job_id"])
    assert manifest["resumes"][-1]["previous_state"] in ("CANCELLED", "PREEMPTED")
    recs = step_records(run.path)[0]
    assert {r["restart"] for r in recs} == {0, 1} and recs[-1]["step"] == 40
    first_step = {restart: min(r["time"] for r in recs if r["restart"] == restart) for restart in (0, 1)}
    print(f"\nslurm resume: job {first['job_id']} cancelled, resumed from step {result['from_step']} as job "
          f"{result['job_id']}; first resumed step {first_step[1] - t0:.1f} s after `resume` started (the first "
          f"start: {first_step[0] - t_submit:.1f} s after `submit` returned)")
