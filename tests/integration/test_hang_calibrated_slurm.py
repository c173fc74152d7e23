"""Calibrated hang detection (issue 48 item 1) on the real 2-node test cluster, with the defaults: no hang setting.

One job: recipes/gpt_3d.yaml's local profile (Megatron-core TP2 x PP2, 30 steps, a save and an evaluation every 10
steps) on 2 nodes x 2 ranks, `cluster.restarts: 1`, `cluster.hang_timeout_min` left unset (calibrated per phase,
``hpc_tools.runtime.hang_bounds``), each step paced to at least 0.5 s. Once rank 1 has done step FAULT_AT, it is
stopped with SIGSTOP. With the
defaults the step bound is max(60 s, 5 x the slowest observed step) after the warm-up, so the other ranks' watchdogs
name rank 1 as hung about a minute later, and the restart controller starts a new step inside the same allocation
(within 2 minutes of the stop), which resumes from the checkpoint of step 20 and completes with the losses of the
uninterrupted local run (the README's main command, shared with the other tests of the session) bit for bit. The
saves and evaluations before the stop (steps 10 and 20; each save made 4 s slower, 8 paced steps, as from a slow
checkpoint folder) raise no false hang: the manifest records exactly one hang, with its detection time, and the
goodput report shows it. Figures are printed with -s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from statistics import median

import pytest

from hpc_tools.registry import RunFolder
from hpc_tools.runtime import hang_bounds, heartbeat
from tests.helpers import in_queue, loss_curve, need_slurm, run_cli, step_records, wait_for

RECIPE = "recipes/gpt_3d.yaml"
FAULT_AT = 25
SETS = ["--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=2", "--set", "cluster.restarts=1",
        "--set", 'cluster.setup.env.OMP_NUM_THREADS="1"', "--set", "cluster.time_limit=15",
        "--set", "cluster.preflight=off",  # not what this tests; it would add its budget to the start
        # every step at least 0.5 s (a sleep in the data time: no loss changes), so that the stop, seen through the
        # heartbeat within a second, lands before the last step; the slowest step stays far below 60 s / 5
        # and every checkpoint save 4 s slower (a slow checkpoint folder: 8 paced steps' time, the saves of steps 10 and
        # 20 must raise no false hang under the step bound)
        "--set", 'cluster.setup.env.HPC_TOOLS_TEST_SLOW_RANK="*:data:0.5,*:save:4"']
DEADLINE_S = 720

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.megatron, pytest.mark.slow]



@pytest.fixture(scope="module")
def hung(tmp_path_factory, main_command) -> dict:
    need_slurm(2)
    tmp = tmp_path_factory.mktemp("hang_calibrated")
    reference = ThreadPoolExecutor(1).submit(main_command, RECIPE)  # the job idles a minute waiting for its verdict
    out = run_cli("submit", RECIPE, "--profile", "local", "--executor", "slurm", "--json", "--runs-dir",
                  str(tmp / "runs"), *SETS, timeout=120)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    run, job_id = RunFolder(job["run_dir"]), job["job_id"]
    stop: dict = {}
    try:
        def stop_rank1() -> bool:
            victim = heartbeat.read_all(run.path, 0).get(1)  # its step: the heartbeat's or its records', newest
            if victim is not None and victim.step >= FAULT_AT:
                os.kill(victim.pid, signal.SIGSTOP)
                stop.update(step=victim.step, time=time.time(), pid=victim.pid)
                return True
            assert in_queue(job_id), (f"job {job_id} ended before step {FAULT_AT}", run.manifest().get("state"))
            return False

        wait_for(stop_rank1, DEADLINE_S, f"job {job_id} to reach step {FAULT_AT}", poll_s=0.1)
        wait_for(lambda: not in_queue(job_id), DEADLINE_S, f"job {job_id} to end", poll_s=2)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    sacct = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True,
                           timeout=30).stdout.split()
    return {"run": run, "job_id": job_id, "stop": stop, "sacct": sacct, "reference": reference.result(timeout=900)}


def test_a_stopped_rank_is_named_with_the_default_bounds_and_restarted_in_the_job(hung):
    run, stop = hung["run"], hung["stop"]
    m = run.manifest()
    assert m["state"] == "COMPLETED" and hung["sacct"] == ["COMPLETED"], (m["state"], hung["sacct"], m.get("reason"))
    [restart] = m["restarts"]
    assert restart["kind"] == "in-job" and restart["cause"] == "hang" and restart["rank"] == 1, restart
    assert restart["reason"].startswith("rank 1 (n1) stopped responding"), restart["reason"]
    [found] = m["hangs"]  # the saves and evaluations at steps 10 and 20 raised none
    # rank 1 first among the culprits: on a shared cluster a node crashed meanwhile by someone else's test has its
    # ranks named beside it (seen: n2's slurmd killed and restarted during the wait, ranks 2,3 "stopped responding")
    assert found["phase"] == "step" and found["ranks"][0] == 1 and found["restart"] == 0, found
    steps = [r["step_time_s"] for r in step_records(run.path)[0] if r["restart"] == 0 and r["step"] > 1]
    # the default bound: max(60 s, 5 x the slowest step), seen by whichever rank gave the verdict (not rank 0 alone)
    assert max(60.0, 5 * max(steps)) - 1 <= found["timeout_s"] <= hang_bounds.DEFAULT_CAP_MIN * 60, found
    assert found["timeout_s"] < found["detected_after_s"] < found["timeout_s"] + 15, found
    restarted_after = datetime.fromisoformat(restart["at"]).timestamp() - stop["time"]
    assert restarted_after < 120, (restarted_after, restart, stop)  # the new step within 2 minutes of the stop
    kept = json.loads((run.path / hang_bounds.FILE).read_text())  # carried to the next start
    assert kept["steps"] >= hang_bounds.WARMUP_STEPS and {"step", "first step", "evaluation"} <= set(kept["max_s"])
    # the slowed saves were seen as saves, several times a step, and under their own bound raised no hang
    assert kept["max_s"][hang_bounds.SAVE] >= 4.0 >= 2 * median(steps), (kept, median(steps))
    print(f"\njob {hung['job_id']}: rank 1 stopped after step {stop['step']}; named after "
          f"{found['detected_after_s']:.0f} s ({found['bound']}); the new step began {restarted_after:.0f} s after "
          f"the stop and resumed from step {restart['from_iteration']}; slowest step {max(steps):.2f} s; bounds kept "
          f"{kept['max_s']}")


def test_the_run_completes_with_the_uninterrupted_losses(hung):
    ref = hung["reference"]
    assert ref["returncode"] == 0, ref["stderr"]
    want = loss_curve(Path(ref["result"]["run_dir"]))
    got = loss_curve(hung["run"].path)
    assert sorted(got) == sorted(want) and len(got) == 30
    assert got == want, {s: (got[s], want[s]) for s in want if got.get(s) != want[s]}
    first_life = {r["step"]: r["loss"] for recs in step_records(hung["run"].path).values() for r in recs
                  if r["restart"] == 0 and r["loss"] is not None}
    recomputed = [s for s in first_life if s > hung["run"].manifest()["restarts"][0]["from_iteration"]]
    assert recomputed and all(first_life[s] == want[s] for s in recomputed)  # the steps lost to the hang, redone


def test_the_goodput_report_shows_the_hang_and_its_detection_time(hung):
    out = run_cli("status", str(hung["run"].path), "--json")
    assert out.returncode == 0, out.stderr
    goodput = json.loads(out.stdout)["goodput"]
    [found] = hung["run"].manifest()["hangs"]
    assert goodput["hangs"] == 1 and goodput["hang_detection_s"] == [found["detected_after_s"]], goodput
