"""A node crash with ``cluster.restarts: 0`` on the real 2-node test cluster (issue 48): the run completes through a
requeue, with the losses of an uninterrupted run bit for bit.

The job is recipes/gpt_zero.yaml's local profile (a tiny LLaMA under ZeRO-2, data parallel over 2 nodes x 1 rank,
one OpenMP thread per rank, as the local uninterrupted run has), a checkpoint every EVERY steps, no in-job restarts.
Once it has done FAULT_AT steps, every process of n2 is killed with SIGKILL (slurmd, slurmstepd, the rank:
``hpc_tools.testing.slurm_faults.crash_node``) and n2's slurmd comes back BACK_AFTER_S later. Rank 0 names its lost
peer and exits; srun would wait for n2's tasks for ever (the controller never took n2 for down: it answered again
within SlurmdTimeout), so the stuck-step watcher beside the step cancels it, and the batch shell's requeue step
requeues the job that lost a node (``hpc_tools.job.requeue.lost_node``). Should Slurm take n2 for failed instead, its
own requeue (NODE_FAIL) or its SIGTERM to a later life's step (``runtime.preemption.requeue_reason``: a termination
that is not the user's cancel) leads to a requeue as well. Each step is paced (HPC_TOOLS_TEST_SLOW_RANK) so that the
resumed life trains for over half a minute. The crash disturbs whatever else runs on n2: the test runs one job.
The job trains the local profile's steps, so its uninterrupted run is the README's main command that the session
shares (tests/conftest.py ``main_command``; checkpoints and the pace's sleeps change no loss). It trained 100 steps
paced 0.4 s against a 100-step run of its own: the same pacing time, 70 steps and two rank starts more.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder
from tests.helpers import loss_curve, run_cli, sbatch_rendered
from tests.integration.test_restarts_slurm import in_queue, newest_step, sacct_lines

RECIPE = "recipes/gpt_zero.yaml"
ITERS, FAULT_AT, EVERY = 30, 10, 5  # ITERS: the local profile's, the shared uninterrupted run's
BACK_AFTER_S = 20
PACE_S = 1.6  # per step, in the job only: the resumed life trains 20 steps for >= 32 s
COMMON = ["--profile", "local", "--set", f"training.train_iters={ITERS}", "--set", f"checkpoint.interval_iters={EVERY}",
          "--set", 'cluster.setup.env.OMP_NUM_THREADS="1"']
JOB = ["--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=1", "--set", "cluster.restarts=0",
       "--set", "cluster.time_limit=20", "--set", "cluster.preflight=off",
       "--set", f'cluster.setup.env.HPC_TOOLS_TEST_SLOW_RANK="*:data:{PACE_S}"']
DEADLINE_S = 900

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.deepspeed, pytest.mark.slow]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, main_command) -> dict:
    """One job, n2 crashed after FAULT_AT steps and its slurmd back BACK_AFTER_S later, waited for to its end."""
    from hpc_tools.testing.slurm_faults import crash_node, node_state, restart_slurmd
    from tests.helpers import need_slurm, wait_for

    need_slurm(2)
    assert load_recipe(RECIPE, profile="local").training.train_iters == ITERS
    tmp = tmp_path_factory.mktemp("node-crash")
    box: dict = {}
    ref = threading.Thread(target=lambda: box.update(out=main_command(RECIPE)), daemon=True)
    ref.start()
    job_id, path = sbatch_rendered(tmp, "crash", RECIPE, *COMMON, *JOB)
    run = RunFolder(path)
    crashed_at = back_at = None
    fault_step = None
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and in_queue(job_id):
            if fault_step is None and newest_step(run, 0) >= FAULT_AT:
                fault_step = newest_step(run, 0)
                crash_node("n2")
                crashed_at = time.time()
            if crashed_at and not back_at and time.time() - crashed_at >= BACK_AFTER_S:
                restart_slurmd("n2")
                back_at = time.time()
            time.sleep(0.2)
        ref.join(timeout=max(deadline - time.monotonic(), 1))
        m = run.manifest()
        print(f"\njob {job_id}: crash after step {fault_step}, state {m.get('state')}, events "
              f"{[e.get('event') for e in m.get('events', [])]}")
        yield {"job_id": job_id, "run": run, "fault_step": fault_step, "reference": box.get("out")}
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
        if crashed_at and not back_at:
            restart_slurmd("n2")
        if crashed_at:  # as the elastic test leaves it: n2 usable for the next module
            subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], capture_output=True, timeout=10)
            wait_for(lambda: node_state("n2") in ("idle", "mixed", "allocated"), timeout_s=120, what="n2 back")


def test_a_crashed_node_without_restarts_completes_through_requeues(crashed):
    run: RunFolder = crashed["run"]
    assert crashed["fault_step"] is not None, f"n2 was never crashed (job {crashed['job_id']})"
    assert not in_queue(crashed["job_id"]), f"job {crashed['job_id']} still queued: {run.manifest().get('state')}"
    m = run.manifest()
    assert m["state"] == "COMPLETED", (m["state"], m.get("reason"), m["events"][-6:])
    records = [x for x in sacct_lines(crashed["job_id"]) if x[0] == crashed["job_id"]]
    assert records[-1][1] == "COMPLETED" and len(records) >= 2, records  # requeued at least once by the crash
    out = crashed["reference"]
    assert out is not None and out["returncode"] == 0 and out["result"].get("run_dir"), out and out["stderr"][-3000:]
    want = loss_curve(Path(out["result"]["run_dir"]))
    got = loss_curve(run.path)
    assert sorted(want) == list(range(1, ITERS + 1))
    assert got == want, {s: (got.get(s), want[s]) for s in want if got.get(s) != want[s]}
    status = json.loads(run_cli("status", str(run.path), "--json").stdout)
    assert status["status"] == "completed", status
