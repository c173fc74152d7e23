"""Preemption on the real Slurm test cluster (environment/slurm-dev): a Megatron run that receives the stop signal
checkpoints, requeues itself, resumes and finishes with the same losses as an uninterrupted run.

The job is recipes/gpt_3d.yaml's local profile (TP2 x PP2 on 4 CPU ranks of one node) cut to its first 12 steps (the
learning-rate schedule of the full 30 kept), submitted with the real CLI
(`python -m hpc_tools submit ... --executor slurm`). Once its ranks are up the test sends SIGUSR2 with
`scancel --signal=USR2`: the signal Slurm itself sends `cluster.signal_delay_s` before the time limit
(`--signal=USR2@N`). Triggering it at a known step keeps the test fast and deterministic; Slurm's own time-limit
timer fires anywhere in a 30 s window, so a time-limit-driven test is either slow or flaky on a 2-core machine (it was
checked by hand: with time_limit=2, signal_delay_s=60 the job was stopped, requeued and resumed 8 times and completed;
tests/integration/test_time_limit_requeue.py runs that path). The signal goes once every rank has its handler (its
heartbeat file exists), with the ranks held (SIGSTOP) until it is pending in each: the stop then comes at the step
boundary after their next step, whatever the machine's speed. (Sent when rank 0's records showed step 3, on a fast
machine it arrived after the last step: the 12 steps took 4 s, and records reach their file every 2 s.)

Both runs (the uninterrupted one is the README's main command, run locally) use one OpenMP thread per rank, so the
losses must be bit-identical (with torch's default thread count the order of float sums, and so the last bit of some
losses, depends on the thread count).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import READER
from hpc_tools.runtime import heartbeat
from tests.helpers import REPO, wait_for

RECIPE = REPO / "recipes" / "gpt_3d.yaml"
# The uninterrupted run's first 12 steps (of 30): its learning-rate schedule kept, so each step's loss is the same.
ITERS = 12
SETS = ['cluster.setup.env.OMP_NUM_THREADS="1"', "cluster.hang_timeout_min=5", f"training.train_iters={ITERS}",
        f"training.lr_decay_iters={load_recipe(RECIPE, profile='local').training.train_iters}"]

pytestmark = [pytest.mark.slurm, pytest.mark.megatron, pytest.mark.slow]


def losses(run_dir: Path) -> dict[int, float]:
    found: dict[int, float] = {}
    for path in (run_dir / "records").glob("rank*.jsonl"):
        for rec in map(json.loads, path.read_text().splitlines()):
            if rec["loss"] is not None:
                found[rec["step"]] = rec["loss"]
    return found


def usr2_pending(pid: int) -> bool:
    """Whether SIGUSR2 waits to be delivered to (stopped) process ``pid`` (/proc/PID/status: SigPnd, ShdPnd)."""
    bit = 1 << (signal.SIGUSR2 - 1)
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return any(int(ln.split()[1], 16) & bit for ln in lines if ln.startswith(("SigPnd:", "ShdPnd:")))


def signal_lines(pid: int) -> str:
    """/proc/PID/status's state and signal masks, for a failure message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return f"gone ({exc.strerror})"
    return " ".join(ln.replace("\t", "") for ln in lines if ln.startswith(("State:", "SigPnd:", "ShdPnd:", "SigIgn:",
                                                                          "SigCgt:")))


def signal_held_ranks(run: RunFolder, job_id: str, world: int) -> None:
    """``scancel --signal=USR2`` once every rank of start 0 wrote its heartbeat (the rank program installs its signal
    handlers before it starts its watchdog), every rank stopped until the signal is pending in each (the test
    cluster's nodes share this machine's process table: the heartbeats' pids are theirs)."""
    beats = wait_for(lambda: (b := heartbeat.read_all(run.path, restart=0)) and len(b) == world and b, 420,
                     f"the {world} ranks' heartbeats of job {job_id}", poll_s=0.1)
    pids = [b.pid for b in beats.values()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        # Sent again until it is pending in every rank: once here the signal went 2.5 s after the job started (the
        # ranks already beating) and never arrived in 60 s (slurmctld logged the request; the step had only just
        # been launched, and a step slurmstepd does not yet count as running may not be signalled). A second copy of
        # a pending signal is not queued: each rank still stops once.
        deadline = time.monotonic() + 120
        while not all(usr2_pending(p) for p in pids):
            assert time.monotonic() < deadline, "SIGUSR2 not pending in every held rank after 120 s: " + \
                ", ".join(f"{p}: {signal_lines(p)}" for p in pids if not usr2_pending(p))
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True, capture_output=True, timeout=30)
            until = time.monotonic() + 10
            while time.monotonic() < until and not all(usr2_pending(p) for p in pids):
                time.sleep(0.1)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def finished(run: RunFolder, job_id: str) -> str | None:
    state = run.manifest()["state"]
    if state == "COMPLETED":
        return state
    job = READER.job(job_id)
    if job and job.terminal and job.run_state != "COMPLETED":
        logs = "\n".join(p.read_text()[-1500:] for p in sorted((run.path / "submitit").glob("*_0_log.*")))
        raise AssertionError(f"job {job_id} ended {job.state}:\n{logs}")
    return None


def test_stop_signal_requeues_and_resumes_to_the_same_losses(slurm, cli, tmp_path, main_command):
    sets = [x for s in SETS for x in ("--set", s)]
    # The uninterrupted run (below) goes on beside the Slurm job, which spends much of its time waiting (queue,
    # requeue, start-up); when another test of the session has made it already, this only reads it.
    uninterrupted = ThreadPoolExecutor(1).submit(main_command, "recipes/gpt_3d.yaml")
    t0 = time.monotonic()
    out = cli("submit", str(RECIPE), "--profile", "local", "--executor", "slurm", "--json",
              "--runs-dir", str(tmp_path / "slurm_runs"), *sets, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    run, job_id = RunFolder(result["run_dir"]), result["job_id"]
    try:
        signal_held_ranks(run, job_id, 4)
        wait_for(lambda: finished(run, job_id), 600, f"job {job_id} to complete after the requeue", poll_s=2)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)  # no-op once it is done
    wall_s = time.monotonic() - t0

    manifest = run.manifest()
    preempted = [e for e in manifest["events"] if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["state"] == "REQUEUED", manifest["events"]
    stopped_at = preempted[0]["last_step"]
    records0 = [json.loads(x) for x in (run.records_dir / "rank00000.jsonl").read_text().splitlines()]
    iters = len(records0)
    assert [r["step"] for r in records0] == list(range(1, iters + 1)), "steps continue across the requeue"
    assert {r["restart"] for r in records0 if r["step"] <= stopped_at} == {0}
    assert {r["restart"] for r in records0 if r["step"] > stopped_at} == {1}, "later steps come from the requeued job"

    recipe = load_recipe(RECIPE, overrides=SETS, profile="local")
    assert iters == recipe.training.train_iters
    # The uninterrupted run: the README's main command (the local executor gives every rank one OpenMP thread, as
    # SETS does on Slurm; hang_timeout_min changes no number), shared with the tests that read the same run: its
    # first ITERS steps.
    uninterrupted = uninterrupted.result(timeout=900)
    assert uninterrupted["returncode"] == 0, uninterrupted["stderr"]
    reference = RunFolder(uninterrupted["result"]["run_dir"])
    assert reference.manifest()["state"] == "COMPLETED"
    got, want = losses(run.path), {s: loss for s, loss in losses(reference.path).items() if s <= ITERS}
    assert sorted(got) == list(range(1, iters + 1))
    assert got == want, {s: (got[s], want[s]) for s in want if got.get(s) != want[s]}
    print(f"\nslurm job {job_id}: stopped at step {stopped_at}, requeued, resumed, COMPLETED in {wall_s:.0f} s; "
          f"{iters} losses equal to the uninterrupted local run")
